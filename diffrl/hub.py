"""Whether the Hugging Face hub is switched off: the one test that pipeline loading, export and the rewards share."""

from __future__ import annotations

import os

from huggingface_hub import constants


def hub_offline() -> bool:
    """Whether the user switched the hub off, read as `huggingface_hub.constants.HF_HUB_OFFLINE` reads it
    (`HF_HUB_OFFLINE`, or `TRANSFORMERS_OFFLINE` when that is unset) but at call time, so a variable set after
    `huggingface_hub` was imported counts too; or when that constant itself says so."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return (value or "").upper() in constants.ENV_VARS_TRUE_VALUES or bool(constants.HF_HUB_OFFLINE)
