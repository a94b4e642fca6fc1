"""Integrations of rl_kernels with model libraries, each imported on demand:

    from rl_kernels.integrations import transformers as rlk_tf   # imports transformers itself

``import rl_kernels`` never imports a model library.
"""
