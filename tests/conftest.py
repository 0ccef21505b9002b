"""Tests never contact the Hugging Face hub: the library only goes offline when told to, so the tests
say so here (before ``datasets``/``transformers`` are imported) and in the environments of the
processes they start."""

import os

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")
