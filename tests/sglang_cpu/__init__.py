"""SGLang's own server on CPU for the test suite (``make sglang-cpu``).

* ``install.sh``: ``.venv-sglang``, SGLang 0.5.23 layered over ``.venv`` (its torch reused).
* ``sgl_kernel/``: the project's own pure-torch module standing in for SGLang's compiled kernels, which have no
  CPU build on PyPI. Pinned to ``sglang==0.5.23`` (it leans on which names that release imports); one kernel is
  implemented, every other name fails loudly when called. Not SGLang's code.
* ``tests/conftest.py`` starts servers with ``paravt serve``'s own launcher (``sglang_command(device="cpu")``).
"""
