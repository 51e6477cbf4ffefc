"""Developer tools for the Triton kernels (``fastcl.kernels``), outside the runtime package.

* ``python -m benchmarks.triton_tools.tune``: times the config candidates on a GPU and writes
  the tuned table (``kernels/tuned/<arch>.json``, package data the kernels read at run time);
* ``python -m benchmarks.triton_tools.aot``: compiles every recorded launch for sm_80 and
  sm_90 and prints its compile facts (no GPU needed).

A training step never imports these (docs/triton.md, "Config tables").
"""
