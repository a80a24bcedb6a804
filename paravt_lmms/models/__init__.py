"""lmms-eval's two registration hooks for the ``paravt`` model."""

#: read by ``LMMS_EVAL_PLUGINS=paravt_lmms``: model name → class in ``paravt_lmms.models.<name>``
AVAILABLE_MODELS = {"paravt": "ParaVT"}


def manifest():
    """The ``lmms_eval.models`` entry point (lmms-eval 0.7's registry): imported by lmms-eval only."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id="paravt", simple_class_path="paravt_lmms.models.paravt.ParaVT")
