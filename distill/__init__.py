"""Draftsmith's training engine: recipes' typed configs, data, targets, trainer, checkpoints, logging.

:mod:`distill.base` is the leaf the model packages (``drafters``, ``parcae``) and the decoding loop
(``serve_eval``) share with the engine; importing any of them changes nothing in the user's process
(the command line quiets third-party noise itself: :func:`distill.quiet.quiet_third_party`).
"""
