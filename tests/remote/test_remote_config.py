"""c.GPUSnapshot remote settings build a working remote store (against the real S3 server)."""

from __future__ import annotations

from traitlets.config import Config

from jupyter_gpu_snapshot.config import GPUSnapshot
from jupyter_gpu_snapshot.node.remotes import make_remote_store, make_snapshot_cache
from testkit.remote_snapshots import make_snapshot, tree_bytes
from testkit.seaweed import ACCESS_KEY, SECRET_KEY


def test_settings_make_an_encrypting_store(seaweed, remote_url, tmp_path, monkeypatch):
    key_file = tmp_path / "remote.key"
    key_file.write_text("ab" * 32)
    key_file.chmod(0o600)
    config = Config()
    config.GPUSnapshot.store_dir = str(tmp_path / "cache")
    config.GPUSnapshot.remote_url = remote_url
    config.GPUSnapshot.remote_endpoint_url = seaweed.endpoint_url
    config.GPUSnapshot.remote_options = {"skip_instance_cache": True}
    config.GPUSnapshot.remote_encryption_key_file = str(key_file)
    config.GPUSnapshot.remote_cache_max_bytes = 1 << 30
    # Credentials come from the usual AWS chain, here the environment.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    settings = GPUSnapshot(config=config)

    remote = make_remote_store(settings)
    assert remote is not None and remote.key == bytes.fromhex("ab" * 32)
    cache = make_snapshot_cache(settings)
    assert cache.max_bytes == 1 << 30
    snap = make_snapshot(cache.store, {"pages-1.img": 4096})
    assert remote.upload(snap.path).encrypted
    assert tree_bytes(remote.download(snap.id, tmp_path / "b")) == tree_bytes(snap.path)


def test_no_remote_url_means_no_remote_store(monkeypatch):
    monkeypatch.delenv("JUPYTER_GPU_SNAPSHOT_REMOTE_URL", raising=False)
    assert make_remote_store(GPUSnapshot()) is None
