"""Deciding before a run: where each group's state lives (``placement``) and every ``auto`` of a config
(``resolve``)."""
