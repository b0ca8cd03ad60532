"""What a distillation run is asked for, and the target layers it resolves to."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedModel

from specdec_cli.methods.feature.eagle import eagle3_layers

ANSWER_KINDS = ("all", "greedy", "sampled")  # the answers trained on: every one, or only one kind
FORMATS = ("specdec", "eagle3")  # the draft specdec trains, or EAGLE-3's (methods/feature/eagle3_export.py)
EAGLE3_LAYOUTS = (
    "specforge",
    "speculators",
)  # the files an EAGLE-3 draft is saved as (methods/feature/eagle3_export.py)


@dataclass
class DistillSettings:
    num_layers: int = 1
    # the target hidden states the draft reads (indices of transformers' `hidden_states`, -1 the
    # last); None: the inputs of layers 2, L // 2 and L - 3, as EAGLE-3 reads them
    target_layers: tuple[int, ...] | None = None
    init_layers: tuple[int, ...] | None = None  # target layers the draft's layers start from (None: spaced)
    zero_features: bool = False  # start as a token-only draft (the state's part of the projection 0)
    position_decay: float = 0.8  # loss weight of draft position k is decay ** k (EAGLE-3)
    # a draft position's loss over the target's top-k probabilities p and the draft's q: "kl",
    # cross-entropy (forward KL, as EAGLE trains), or "tv", 1 - sum min(p, q): one minus the acceptance
    # at temperature 1
    loss: str = "kl"
    draft_positions: int = 3  # draft positions trained: the 1st reads target states, later ones its own
    answers_per_prompt: int = 4  # sampled at temperature 1, plus one greedy answer
    synthetic_prompts: int = 2048  # prompts the target writes itself, answered once each
    answer_tokens: int = 192
    top_k: int = 32  # target probabilities kept per position
    draft_vocab: int = 8192
    training_steps: int = 3000
    answers_per_step: int = 8
    learning_rate: float = 1e-3
    eval_every: int = 250
    training_tokens: int | None = None  # answer tokens trained on, a seeded sample (None: all)
    trained_answers: str = "all"  # or "greedy" or "sampled": only the target's answers of that kind
    heldout_prompts: float = 0.1  # of the given prompts: their answers are never trained on
    heldout_answers: str | None = None  # a file of answers held out instead (to prompts unlike the training ones)
    seed: int = 0
    format: str = "specdec"  # or "eagle3": EAGLE-3's architecture, saved in its layout
    layout: str = "specforge"  # an EAGLE-3 draft's files: SpecForge's, or vllm-project/speculators'


def read_layers(settings: DistillSettings, target: PreTrainedModel) -> tuple[int, ...]:
    """The target states the draft reads: the settings', or the inputs of layers 2, L // 2 and L - 3
    (EAGLE-3's choice: low, middle and high; all of them on a target of 3 layers or fewer)."""
    count = target.config.num_hidden_layers
    default = eagle3_layers(count) if count > 3 else tuple(range(count + 1))
    return settings.target_layers or default
