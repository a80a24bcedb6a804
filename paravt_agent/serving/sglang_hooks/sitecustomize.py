"""Run by every Python process of an SGLang server ``paravt serve`` starts (this folder is first on its
``PYTHONPATH``): the server-side timeout of its weight-update groups.

SGLang 0.5.23 makes the group ``/init_weights_update_group`` joins with torch's default timeout (30 minutes), and a
bucket's receive blocks its scheduler until the broadcast ends: a trainer host that dies mid-bucket (no TCP reset
reaches the server) would leave every user's request waiting half an hour, ``/continue_generation`` included. With
``PARAVT_WEIGHT_GROUP_TIMEOUT`` (seconds) set, torch's default group timeout in the server's processes is that:
the receive fails after it, SGLang answers the update with an error and its scheduler goes on. Nothing else of the
server is touched; without the variable this file only hands over to another ``sitecustomize`` on the path.
"""

import os
import sys

_SECONDS = os.environ.get("PARAVT_WEIGHT_GROUP_TIMEOUT")
_TARGET = "torch.distributed.distributed_c10d"


def _set_timeout(module) -> None:
    import datetime

    module.default_pg_timeout = datetime.timedelta(seconds=float(_SECONDS))


if _SECONDS:
    import importlib.abc
    import importlib.util

    class _AfterC10d(importlib.abc.MetaPathFinder):
        """Finds torch's c10d module as usual, and sets its default timeout right after it runs."""

        def find_spec(self, name, path=None, target=None):
            if name != _TARGET:
                return None
            sys.meta_path.remove(self)  # once: the module is imported once per process
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module

                def exec_module(module, run=run):
                    run(module)
                    _set_timeout(module)

                spec.loader.exec_module = exec_module
            return spec

    if _TARGET in sys.modules:
        _set_timeout(sys.modules[_TARGET])
    else:
        sys.meta_path.insert(0, _AfterC10d())

# another sitecustomize on the path (a distribution's, a venv's) still runs
_here = os.path.dirname(os.path.abspath(__file__))
for _dir in sys.path:
    _file = os.path.join(_dir or ".", "sitecustomize.py")
    if os.path.abspath(_dir or ".") != _here and os.path.isfile(_file):
        with open(_file) as _f:
            exec(compile(_f.read(), _file, "exec"), {"__name__": "sitecustomize", "__file__": _file})
        break
