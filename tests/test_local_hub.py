"""The stand-in hub (tests/local_hub.py) answers the real huggingface_hub client as huggingface.co does."""

import hashlib

import pytest
from local_hub import LocalHub, patched_endpoint

WEIGHTS = b"\x00\x01" * 5000


@pytest.fixture()
def hub():
    with LocalHub() as h:
        h.add_revision("org/tiny", "step100", {"config.json": b"{}", "model.safetensors": WEIGHTS})
        h.add_revision("org/tiny", "main", {"config.json": b"{}", "model.safetensors": WEIGHTS + b"x"})
        with patched_endpoint(h.endpoint):
            yield h


def test_refs_metadata_and_download_by_commit(hub, tmp_path):
    """Branches list with their commits; weight files carry their sha256 before any download; a download by commit."""
    import huggingface_hub as hh

    refs = {b.name: b.target_commit for b in hh.list_repo_refs("org/tiny").branches}
    assert refs == {"step100": hub.commit_of("org/tiny", "step100"), "main": hub.commit_of("org/tiny", "main")}
    info = hh.model_info("org/tiny", revision=refs["step100"], files_metadata=True)
    meta = {s.rfilename: s for s in info.siblings}
    assert meta["model.safetensors"].lfs.sha256 == hashlib.sha256(WEIGHTS).hexdigest() and meta["config.json"].lfs is None
    assert hub.downloads() == []  # metadata only
    path = hh.hf_hub_download("org/tiny", "model.safetensors", revision=refs["step100"], cache_dir=tmp_path)
    assert open(path, "rb").read() == WEIGHTS
    assert hub.downloads("model.safetensors") == [f"/org/tiny/resolve/{refs['step100']}/model.safetensors"]


def test_a_moved_branch_keeps_its_old_commit(hub):
    """Re-pointing a branch makes a new commit; the old one stays downloadable by its id."""
    import huggingface_hub as hh

    old = hub.commit_of("org/tiny", "main")
    new = hub.move_branch("org/tiny", "main", {"config.json": b"{}", "model.safetensors": b"new"})
    assert new != old and {b.name: b.target_commit for b in hh.list_repo_refs("org/tiny").branches}["main"] == new
    assert hh.model_info("org/tiny", revision=old).sha == old


def test_injected_503_on_the_download_fails_it_once(hub, tmp_path):
    """A 503 injected on the GET of a weights file reaches the client (huggingface_hub does not retry it); the next try works."""
    import huggingface_hub as hh
    from huggingface_hub.errors import HfHubHTTPError

    hub.fail("model.safetensors", times=1, status=503, method="GET")
    with pytest.raises(HfHubHTTPError):
        hh.hf_hub_download("org/tiny", "model.safetensors", revision="main", cache_dir=tmp_path)
    assert open(hh.hf_hub_download("org/tiny", "model.safetensors", revision="main", cache_dir=tmp_path), "rb").read() == WEIGHTS + b"x"


def test_remote_files_reads_sizes_and_hashes_without_downloading(hub):
    """sinkwatch.replay.hub.remote_files: every file's size and the weights' sha256, from metadata only."""
    from sinkwatch.replay.hub import remote_files

    files = {f.path: f for f in remote_files("org/tiny", hub.commit_of("org/tiny", "step100"))}
    assert files["model.safetensors"].sha256 == hashlib.sha256(WEIGHTS).hexdigest() and files["model.safetensors"].is_weights
    assert files["model.safetensors"].size == len(WEIGHTS) and files["config.json"].sha256 is None and not files["config.json"].is_weights
    assert hub.downloads() == []
    # a commit never changes: listing, plan and download read its metadata with one request; a branch is asked each time
    commit = hub.commit_of("org/tiny", "step100")
    asked = [p for m, p, s in hub.log if p.startswith("/api/models/org/tiny/revision/")]
    assert remote_files("org/tiny", commit) == list(files.values())
    for _ in range(2):
        remote_files("org/tiny", "step100")
    after = [p for m, p, s in hub.log if p.startswith("/api/models/org/tiny/revision/")]
    assert after[len(asked) :] == ["/api/models/org/tiny/revision/step100"] * 2
