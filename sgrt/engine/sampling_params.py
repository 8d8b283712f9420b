"""``SamplingParams`` for the engine's modules: it lives in :mod:`sgrt.sampling_params`, below
the engine and the DSL both (the DSL takes its defaults from it without importing the engine)."""
from sgrt.sampling_params import (  # noqa: F401 - re-exported
    JUMP_FORWARD_MODES, SPECULATIVE_MODES, TRUNCATE_MODES, SamplingParams, check_speculative,
)
