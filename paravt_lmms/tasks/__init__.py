"""lmms-eval's plugin hook (``LMMS_EVAL_PLUGINS=paravt_lmms``) searches this folder for task YAMLs. ParaVT ships
none here: its toy tasks name their own data, so ``paravt-lmms task --out DIR`` writes them with it."""
