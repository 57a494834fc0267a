import pytest

from sparsegen.output import check_output, new_file, new_folder


def test_a_folder_appears_complete_or_not_at_all(tmp_path):
    out = tmp_path / "ckpt"
    with pytest.raises(OSError):
        with new_folder(out) as work:
            (work / "config.json").write_text("{}")
            raise OSError(28, "No space left on device")  # a full disk halfway
    assert not out.exists() and list(tmp_path.iterdir()) == []
    with new_folder(out) as work:
        (work / "config.json").write_text("{}")
        (work / "model.safetensors").write_text("weights")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_replacing_swaps_the_folder_whole(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "stale.safetensors").write_text("old run")
    with pytest.raises(ValueError, match="--force"):
        with new_folder(out):
            pass
    with new_folder(out, overwrite=True) as work:
        (work / "config.json").write_text("{}")
    assert [p.name for p in out.iterdir()] == ["config.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary left behind


def test_files_and_folders_are_not_confused(tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        check_output(a_file)
    with pytest.raises(ValueError, match="is a folder"):
        check_output(tmp_path, folder=False)
    with pytest.raises(ValueError, match="input model's own folder"):
        check_output(tmp_path, source=tmp_path, overwrite=True)
    with new_file(a_file, overwrite=True) as work:
        work.write_text("y")
    assert a_file.read_text() == "y" and [p.name for p in tmp_path.iterdir()] == ["f"]


def test_prune_leaves_no_half_checkpoint_when_writing_fails(tiny_checkpoint, tmp_path, monkeypatch):
    from transformers import PreTrainedModel

    from sparsegen.cli import main

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full_disk)
    out = tmp_path / "pruned"
    assert main(["prune", "--model", str(tiny_checkpoint), "--method", "magnitude", "--sparsity", "0.5",
                 "--out", str(out)]) == 2
    assert not out.exists() and list(tmp_path.iterdir()) == []
