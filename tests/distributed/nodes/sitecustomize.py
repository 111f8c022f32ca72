"""Put first on the PYTHONPATH of the simulated nodes' processes (tests/distributed/test_multinode.py).

Stands in for reading a GGUF file, which would take each node most of a minute: a ``.gguf`` model is read as the
folder ``SCGRPO_TEST_GGUF_SOURCE`` names, and the rest of the conversion is the package's own (the cache's lock,
the folder written beside its place and renamed into it). Each conversion is recorded as a line of
``$SCGRPO_TEST_CONVERSIONS``."""

import os

if os.environ.get("SCGRPO_TEST_GGUF_SOURCE"):
    import scgrpo.models

    def _load(gguf_path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        with open(os.environ["SCGRPO_TEST_CONVERSIONS"], "a") as log:
            log.write(f"{os.getpid()} {gguf_path}\n")
        source = os.environ["SCGRPO_TEST_GGUF_SOURCE"]
        return AutoModelForCausalLM.from_pretrained(source), AutoTokenizer.from_pretrained(source)

    scgrpo.models.load_gguf = _load
