"""ParaVT as an lmms-eval model: ``lmms-eval --model paravt`` runs the whole agent (planner, K sub-agents,
answer) on lmms-eval's own tasks, with their prompts and their scoring.

Install lmms-eval beside ParaVT (``pip install 'paravt[lmms-eval]'``; ``make lmms-eval`` builds a
``.venv-lmms`` layered over ``.venv``, since lmms-eval pins PyAV below 16), then::
    lmms-eval --model paravt --model_args backend=local,model=checkpoints/toy --tasks videomme \\
        --output_path runs/lmms --log_samples

The model registers itself through lmms-eval's ``lmms_eval.models`` entry point; the older hook
``LMMS_EVAL_PLUGINS=paravt_lmms`` works too (it also adds ``paravt_lmms/tasks`` to the task search path).
``paravt-lmms task --out DIR`` writes local toy tasks (videos, data, YAML) for a run without the hub:
``lmms-eval --model paravt --include_path DIR --tasks paravt_toy,paravt_toy_videomme``.
"""
