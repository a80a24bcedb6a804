"""Run by every Python process of an SGLang server ``paravt serve`` starts (this folder is first on its
``PYTHONPATH``): the server-side timeout of its weight-update groups.

SGLang 0.5.23 makes the group ``/init_weights_update_group`` joins with torch's default timeout (30 minutes), and a
bucket's receive blocks its scheduler until the broadcast ends: a trainer host that dies mid-bucket (no TCP reset
reaches the server) would leave every user's request waiting half an hour, ``/continue_generation`` included. With
``PARAVT_WEIGHT_GROUP_TIMEOUT`` (seconds) set, the weight updater's ``init_custom_process_group`` (SGLang's module
``model_runner_components/weight_updater.py``, the only caller that makes weight-update groups) gets that timeout
when it passes none: the receive fails after it, SGLang answers the update with an error and its scheduler goes
on. SGLang's own groups (tensor parallelism, its gloo CPU groups) keep torch's defaults: a long weight load on
many GPUs must not time them out. Without the variable this file only hands over to another ``sitecustomize``.
"""

import os
import sys

_SECONDS = os.environ.get("PARAVT_WEIGHT_GROUP_TIMEOUT")
_TARGET = "sglang.srt.model_executor.model_runner_components.weight_updater"


def _bound(module) -> None:
    import datetime
    import functools

    make = getattr(module, "init_custom_process_group", None)
    if make is None or getattr(make, "_paravt_timeout", False):
        return

    @functools.wraps(make)
    def init_custom_process_group(*args, **kwargs):
        if kwargs.get("timeout") is None:
            kwargs["timeout"] = datetime.timedelta(seconds=float(_SECONDS))
        return make(*args, **kwargs)

    init_custom_process_group._paravt_timeout = True
    module.init_custom_process_group = init_custom_process_group


if _SECONDS:
    import importlib.abc
    import importlib.util

    class _AfterWeightUpdater(importlib.abc.MetaPathFinder):
        """Finds SGLang's weight-updater module as usual, and bounds its groups right after it runs."""

        def find_spec(self, name, path=None, target=None):
            if name != _TARGET:
                return None
            sys.meta_path.remove(self)  # once: the module is imported once per process
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module

                def exec_module(module, run=run):
                    run(module)
                    _bound(module)

                spec.loader.exec_module = exec_module
            return spec

    if _TARGET in sys.modules:
        _bound(sys.modules[_TARGET])
    else:
        sys.meta_path.insert(0, _AfterWeightUpdater())

# another sitecustomize on the path (a distribution's, a venv's) still runs
_here = os.path.dirname(os.path.abspath(__file__))
for _dir in sys.path:
    _file = os.path.join(_dir or ".", "sitecustomize.py")
    if os.path.abspath(_dir or ".") != _here and os.path.isfile(_file):
        with open(_file) as _f:
            exec(compile(_f.read(), _file, "exec"), {"__name__": "sitecustomize", "__file__": _file})
        break
