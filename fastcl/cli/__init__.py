"""Sub-commands of ``python -m fastcl`` (one module each, registered in ``fastcl.__main__``)."""
