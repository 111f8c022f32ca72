"""Put first on the PYTHONPATH of the simulated nodes' processes (tests/distributed/test_multinode.py).

Stands in for the GGUF conversion, which would take each node most of a minute: a ``.gguf`` model is "converted" by
copying the folder ``SCGRPO_TEST_GGUF_SOURCE`` names into the cache, through the package's own caching (the lock,
the atomic rename), and each conversion is recorded as a line of ``$SCGRPO_CACHE/conversions.log``."""

import os

if os.environ.get("SCGRPO_TEST_GGUF_SOURCE"):
    import shutil
    import tempfile
    from pathlib import Path

    import scgrpo.models

    def _copy(gguf_path: Path, out_dir: Path) -> Path:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + ".tmp"))
        shutil.copytree(os.environ["SCGRPO_TEST_GGUF_SOURCE"], tmp, dirs_exist_ok=True)
        with open(Path(os.environ["SCGRPO_CACHE"]) / "conversions.log", "a") as log:
            log.write(f"{os.getpid()} {out_dir}\n")
        tmp.rename(out_dir)
        return out_dir

    scgrpo.models.dequantize_gguf = _copy
