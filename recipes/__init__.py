"""Draftsmith's command layer: the recipes, the command line and the scripts it runs. Importing it first
turns off third-party noise a user cannot act on (:func:`distill.quiet.quiet_third_party`), before any
command imports torch or transformers."""

from distill.quiet import quiet_third_party

quiet_third_party()
