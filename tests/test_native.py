import os
import threading

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
