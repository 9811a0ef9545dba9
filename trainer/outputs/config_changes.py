"""What a rerun changed against the run whose checkpoint it resumes: one ``note:`` line per key, old and new
value, and the run goes on with the new ones (as the Hugging Face Trainer does). What would make the saved
state meaningless — another model's tensors, another tokenizer — is refused by ``trainer.outputs.checkpoint.check``.

The old values are the resolved config the checkpoint records (``tiermem_state.json``'s ``config``).
"""

from __future__ import annotations

import json
from pathlib import Path

# keys not compared: how the rerun is asked for (not what it trains), and the store's config (where the state
# lives, not what it is)
SKIPPED = {"resume_from_checkpoint", "overwrite_output_dir", "tiermem"}
# keys whose value a run decides when it is left unset or auto (the checkpoint records the decision)
DECIDED = {"logging_dir", "tiermem_activation_budget", "tiermem_keep_activations", "torch_compile",
           "tiermem_model_path"}


def _shown(value) -> str:
    return json.dumps(value, default=str)


def changes(saved: dict, now: dict) -> list[tuple[str, object, object]]:
    """(key, old, new) for each key whose value differs between the ``saved`` config and ``now``'s."""
    out = []
    for key, new in now.items():
        if key in SKIPPED or key not in saved:
            continue
        old = saved[key]
        if key in DECIDED and new in (None, "auto"):
            continue
        if old != new and not (isinstance(old, (int, float)) and isinstance(new, (int, float))
                               and not isinstance(old, bool) and float(old) == float(new)):
            out.append((key, old, new))
    return out


def notes(checkpoint: Path, saved: dict | None, now: dict) -> list[str]:
    """The ``note:`` lines of a resume from ``checkpoint`` whose run had the config ``saved`` (None: it records
    none, as checkpoints written before it did)."""
    if not isinstance(saved, dict):
        return []
    name = Path(checkpoint).name
    return [f"note: {key} was {_shown(old)} in the run that saved {name}, {_shown(new)} now: this run goes on with "
            f"{_shown(new)}" for key, old, new in changes(saved, now)]
