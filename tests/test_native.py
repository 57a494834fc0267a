import os
import threading

from torch._inductor import config as inductor_config
from torch.utils import cpp_extension

from sparsegen import native


def test_a_lock_left_by_a_killed_load_is_removed_and_said(tmp_path, monkeypatch, capsys):
    """PyTorch's ``lock`` file, left in the kernels' build folder by a process killed while loading them, would make
    every later load wait forever: the next load removes it, says so, and loads."""
    name = "sparsegen_kernels_test"
    folder = tmp_path / name
    folder.mkdir()
    (folder / "lock").touch()
    loaded = []

    def load(*args, **kwargs):  # (PyTorch's load would wait on its lock file here)
        assert not (folder / "lock").exists()
        loaded.append(args[0])

    monkeypatch.setattr(cpp_extension, "load", load)
    with native.sole_loader(folder):
        cpp_extension.load(name)
    assert loaded == [name] and "left by a process that ended while loading" in capsys.readouterr().err


def test_two_loaders_take_turns_and_a_live_ones_lock_is_never_taken(tmp_path, capsys):
    """While one process loads (its ``lock`` file is PyTorch's own, live), another waits for it, not removing it."""
    folder = tmp_path / "kernels"
    order = []
    with native.sole_loader(folder):
        (folder / "lock").touch()  # (the live load's)
        waiter = threading.Thread(target=lambda: _load_after(folder, order))
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive() and order == []  # (it waits)
        order.append("first")
        os.remove(folder / "lock")  # (the first load ends, as PyTorch's does)
    waiter.join(5)
    assert order == ["first", "second"] and capsys.readouterr().err == ""


def _load_after(folder, order: list) -> None:
    with native.sole_loader(folder):
        order.append("second")


def _vector_isa_setup(monkeypatch, tmp_path, usable: list[str] | None):
    """An empty compile cache folder and inductor's probe replaced by one that counts its calls and
    finds ``usable`` (None: every set the CPU lists)."""
    from torch._inductor import config, cpu_vec_isa

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    flags = ["avx2", "avx512", "avx512_vnni"]
    monkeypatch.setattr(cpu_vec_isa, "x86_isa_checker", lambda: flags)
    listed = [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(isa).split())]
    probes = []

    def probe():
        probes.append(1)
        return [isa for isa in listed if usable is None or str(isa) in usable]

    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", probe)
    return config, probes, [str(isa) for isa in listed]


@inductor_config.patch({"cpp.vec_isa_ok": None})
def test_the_cpus_vector_sets_are_probed_once_a_machine_and_trusted_after(monkeypatch, tmp_path):
    """The first process probes and records; every later one (the same CPU, torch and compiler) probes nothing, and
    both tell inductor the sets are usable, so both compile under the same cache key."""
    config, probes, listed = _vector_isa_setup(monkeypatch, tmp_path, None)
    native.remember_vector_isas()
    assert probes == [1] and config.cpp.vec_isa_ok is True and len(listed) == 3
    config.cpp.vec_isa_ok = None  # (a later process)
    native.remember_vector_isas()
    assert probes == [1] and config.cpp.vec_isa_ok is True
    assert len(list((tmp_path / "vec-isa").glob("*.json"))) == 1


@inductor_config.patch({"cpp.vec_isa_ok": None})
def test_a_vector_set_that_fails_its_probe_leaves_inductor_probing(monkeypatch, tmp_path):
    """AMX listed by the CPU but refused by the OS (a VM): inductor's switch stays unset, so each process probes as
    inductor would and never compiles for a set that cannot run."""
    config, probes, _ = _vector_isa_setup(monkeypatch, tmp_path, ["avx512", "avx2"])
    native.remember_vector_isas()
    native.remember_vector_isas()
    assert probes == [1] and config.cpp.vec_isa_ok is None  # (the record read, the switch left to inductor)


@inductor_config.patch({"cpp.vec_isa_ok": False})
def test_a_users_own_vector_switch_is_left_alone(monkeypatch, tmp_path):
    config, probes, _ = _vector_isa_setup(monkeypatch, tmp_path, None)
    native.remember_vector_isas()
    assert probes == [] and config.cpp.vec_isa_ok is False and not (tmp_path / "vec-isa").exists()
