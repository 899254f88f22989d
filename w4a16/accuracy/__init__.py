"""Accuracy gating with lm-eval: fp vs W4A16 through the reference vs W4A16 through the kernels.

`python -m w4a16 accuracy` (cli.py) reads the gate's definition from `regression/gates.toml` (config.py), loads
each model (loading.py), evaluates every variant with `lm_eval.simple_evaluate` (harness.py) and applies the
gate rules (gate.py). Nothing here is imported by `import w4a16`; lm-eval and transformers load only when the
command runs.
"""
