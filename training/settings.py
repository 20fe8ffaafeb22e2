"""The ``[training]`` section and its ``[training.gate]``, ``[training.correction]``, ``[training.expert]`` and
``[training.rl]`` tables, which the
training package owns, and ``HarnessSettings``: the gateway's settings with ``[training]`` added on top.

The composition sits here, not in ``gateway/config.py``, because dependencies run one way: the gateway never
needs to know training's settings, while ``harness serve`` and ``harness replay-train`` read one file holding
all of them. ``gateway.config.load_settings(..., model=HarnessSettings)`` loads it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from gateway.config import DEFAULT_MODEL_NAME, Settings
from gateway.prompting import Rendering
from tools.settings import Section

Sharding = Literal["auto", "on", "off"]  # [training] fsdp


class GateSettings(Section):
    """Whether a candidate replaces the reference (the active adapter, else the base): both are evaluated on the
    same gate tasks, drawn with a fixed seed from the suite's test templates, and compared by one-sided bounds."""

    tasks: int = Field(100, gt=0, description="Gate tasks drawn from the test templates (at least 100, or at "
                       "least 40 with 3 samples each).")
    samples: int = Field(1, gt=0, description="Episodes per gate task and model (above 1: sampled at "
                         "``temperature``; a task's success is then the share of its samples that succeeded).")
    temperature: float = Field(0.7, gt=0, le=2, description="Sampling temperature when ``samples`` is above 1 "
                               "(one sample is greedy).")
    seed: int = Field(0, description="Seed of the gate tasks' draw and of the bootstrap.")
    confidence: float = Field(0.95, gt=0.5, lt=1, description="Confidence of each one-sided bound.")
    resamples: int = Field(10_000, ge=1000, description="Bootstrap resamples of the paired tasks.")
    min_faulted: int = Field(20, gt=0, description="Gate tasks with an injected tool fault the draw includes at "
                             "least; recovery is judged on them pooled.")
    invalid_call_rate: float = Field(0.05, ge=0, description="Largest rise in the invalid tool-call rate the "
                                     "upper bound may show.")
    general_perplexity: float = Field(0.05, ge=0, description="Largest relative rise in perplexity on held-out "
                                      "general data the upper bound may show (0.05 = 5%).")
    recovery_rate: float = Field(0.1, ge=0, description="Largest drop in success after a tool fault the lower "
                                 "bound may show.")
    min_direct: int = Field(15, ge=0, description="Gate tasks no offered tool fits (to be answered without a "
                            "call) the draw includes at least; abstention is judged on them pooled.")
    abstention_rate: float = Field(0.05, ge=0, description="Largest drop in the rate of answering without a call "
                                   "where no offered tool fits the lower bound may show (0.05 = 5 points).")
    mean_steps: float = Field(1.0, ge=0, description="Largest rise in steps beyond the solver's, on tasks both "
                              "solved, the upper bound may show.")
    looks: list[int] = Field(default_factory=list, description="A sequential gate: the task counts after which it "
                             "also decides, before all ``tasks`` (e.g. [40, 70]); it stops at the first look where "
                             "every check passed or one failed beyond noise, each look's bounds at a confidence "
                             "that spends the false-accept rate over the looks. Empty: one look at all tasks.")

    @model_validator(mode="after")
    def _enough_tasks(self) -> GateSettings:
        if self.tasks < 100 and not (self.tasks >= 40 and self.samples >= 3):
            raise ValueError(f"the gate needs at least 100 tasks, or at least 40 tasks with 3 samples each "
                             f"(got {self.tasks} tasks x {self.samples} samples): fewer cannot tell a real "
                             "improvement from noise")
        points = [*self.looks, self.tasks]
        if any(b <= a for a, b in zip(points, points[1:], strict=False)):
            raise ValueError(f"looks must rise and stay below tasks ({self.tasks}); got {self.looks}")
        first = max(self.min_faulted + self.min_direct, 20)
        if self.looks and self.looks[0] < first:
            raise ValueError(f"the first look needs at least {first} tasks (min_faulted and min_direct, and "
                             f"enough to bound anything); got {self.looks[0]}")
        if self.min_faulted + self.min_direct > self.tasks:
            raise ValueError(f"min_faulted + min_direct ({self.min_faulted + self.min_direct}) exceed the gate's "
                             f"{self.tasks} tasks")
        return self


class ExpertSettings(Section):
    """Expert iteration after SFT (``replay-train --mode sft|sft+rl``): the model's own verified, clean episodes on
    the train tasks it fails greedily, trained on, round after round."""

    rounds: int = Field(0, ge=0, description="Rounds after SFT (0: none).")
    tasks: int = Field(64, gt=0, description="Train tasks each round screens with one greedy episode (in turn "
                       "through the split).")
    samples: int = Field(4, gt=0, description="Episodes per screened task the greedy episode failed, sampled at "
                         "``temperature``.")
    temperature: float = Field(0.7, gt=0, le=2, description="Sampling temperature of the episodes.")
    epochs: float = Field(2.0, gt=0, description="Passes over a round's rows: its kept episodes, the replayed "
                          "demonstrations and general rows at ``general_share``.")
    learning_rate: float = Field(2e-4, gt=0, description="Learning rate of a round's training, which starts from a "
                                 "trained adapter: SFT's own rate undid it.")
    replay: float = Field(3.0, ge=0, description="Rows of SFT's demonstrations mixed into a round per kept "
                          "episode's row, so a round adds to what SFT taught instead of training over it.")


class CorrectionSettings(Section):
    """On-policy correction after SFT (``replay-train --mode sft|sft+rl``, DAgger): the current adapter's own
    episodes on train tasks, each state where its turn differs from the teacher's labelled with the teacher's turn,
    trained on, round after round."""

    rounds: int = Field(0, ge=0, description="Rounds after SFT (0: none).")
    tasks: int = Field(64, gt=0, description="Train tasks each round runs (in turn through the split).")
    samples: int = Field(1, ge=0, description="Episodes per task sampled at ``temperature``, beside the greedy one.")
    temperature: float = Field(0.7, gt=0, le=2, description="Sampling temperature of the sampled episodes.")
    teacher: str = Field("solver", description="Who labels the states: 'solver' (the suite's own, for its tasks) or "
                         "a model the gateway at ``teacher_url`` serves (``replay-train --teacher MODEL``).")
    teacher_url: str = Field("http://127.0.0.1:8000", description="The gateway a served teacher is asked through.")
    teacher_key_env: str = Field("HARNESS_TEACHER_KEY", description="Variable holding the API key a served teacher "
                                 "is asked with.")
    # Filled from teacher_key_env at load time.
    teacher_key: str | None = Field(None, exclude=True)
    aggregate: bool = Field(True, description="Train each round on every round's rows so far (DAgger), not on its "
                            "own alone.")
    epochs: float = Field(2.0, gt=0, description="Passes over a round's rows: the corrections, the replayed "
                          "demonstrations and general rows at ``general_share``.")
    learning_rate: float = Field(2e-4, gt=0, description="Learning rate of a round's training, which starts from a "
                                 "trained adapter.")
    replay: float = Field(3.0, ge=0, description="Rows of SFT's demonstrations mixed into a round per correction "
                          "row, so a round adds to what SFT taught instead of training over it (at 1.0 a round lost "
                          "ground on the test split).")


class RLSettings(Section):
    """Group-relative RL on LoRA (``replay-train --mode rl|sft+rl``): rollouts, the update, validation."""

    algorithm: Literal["grpo", "rloo"] = Field("rloo", description="How a group's rewards become advantages: "
                                               "rloo (reward minus the mean of the others: unscaled) or grpo "
                                               "(scaled by the group's std, so a tiny spread among failures "
                                               "weighs as much as success against failure).")
    outcome: Literal["success", "total"] = Field("success", description="A trajectory's outcome reward: its "
                                                 "verified task success where known (else the reward total), or "
                                                 "the reward engine's total (validity and efficiency included).")
    steps: int = Field(20, ge=0, description="Online steps: each rolls out a batch of groups and updates on it "
                       "(0: only the captured groups the filters select).")
    tasks_per_step: int = Field(8, gt=0, description="Tasks (groups) per step, chosen of similar difficulty.")
    group_size: int = Field(8, ge=2, description="Rollouts per task in a group.")
    temperature: float = Field(1.0, gt=0, le=2, description="Sampling temperature of the rollouts.")
    fault_rate: float = Field(0.2, ge=0, le=1, description="Share of groups whose tools get an injected fault "
                              "(timeout, empty result or error) on their first call, so recovery is practised.")
    learning_rate: float = Field(5e-5, gt=0, description="Learning rate of the RL updates (constant).")
    batch_size: int = Field(4, gt=0, description="Model calls per micro-batch; a step's calls all make one update.")
    updates_per_batch: int = Field(1, gt=0, description="Optimizer steps on each batch of rollouts; beyond the "
                                   "first the clipped importance ratio keeps the policy near the rollouts'.")
    clip: float = Field(0.2, gt=0, lt=1, description="Importance ratios are clipped to [1 - clip, 1 + clip].")
    kl_coef: float = Field(0.04, ge=0, description="Weight of the KL penalty to the policy RL starts from (frozen; "
                           "the base when it starts from a fresh adapter).")
    process_coef: float = Field(0.0, ge=0, description="Weight of each step's own process reward (normalised "
                                "within the group) beside the trajectory's advantage; 0: validity guards (the "
                                "reward-hacking alarm), it is not a reward to farm.")
    eval_every: int = Field(5, gt=0, description="Steps between validations (each saves a checkpoint).")
    validation_tasks: int = Field(0, ge=0, description="Validation tasks per validation, spread over the split "
                                  "(0: all of it).")
    rollback_margin: float = Field(0.05, ge=0, description="A validation success or valid-call rate this far "
                                   "below the best checkpoint's rolls the adapter back to it.")
    max_rollbacks: int = Field(3, ge=0, description="Rollbacks before the run stops.")
    alarm_reward_rise: float = Field(0.05, ge=0, description="Reward-hacking alarm: a rise in mean training "
                                     "reward since the last validation of more than this ...")
    alarm_drop: float = Field(0.05, ge=0, description="... while validation valid-call rate or success fell "
                              "by more than this stops the run.")


class TrainingSettings(Section):
    base_model: str = Field(DEFAULT_MODEL_NAME, description="The served base model adapters are trained for.")
    model_path: str | None = Field(None, description="Weights to train on: a GGUF or checkpoint folder; default "
                                   "the embedded model.")
    output_dir: str = Field("runs", description="Where training runs write checkpoints, metrics and plots.")
    tasks_dir: str = Field("~/.cache/agent-harness/tasks", description="Where task suites keep the fixture "
                           "databases their tools read (made on first use).")
    rank: int = Field(16, gt=0, description="LoRA rank.")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha (scale = alpha / rank).")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Modules LoRA adapts.")
    learning_rate: float = Field(2e-3, gt=0, description="Peak learning rate (linear warm-up, then cosine decay).")
    epochs: float = Field(1.0, gt=0, description="Passes over the training rows.")
    batch_size: int = Field(2, gt=0, description="Rows per micro-batch: a micro-batch's activations are most of what "
                            "training holds (the README's demonstration on 2 CPU cores: 2 rows peaked at 3.7 GB and "
                            "trained at 398 tokens/s, 4 rows at 6.1 GB and 335 tokens/s).")
    grad_accum: int = Field(4, gt=0, description="Micro-batches per optimizer step on each rank (rows per step: "
                            "batch_size times this times the ranks torchrun starts).")
    rank_timeout_seconds: float = Field(7200.0, gt=0, description="Under torchrun: how long a rank waits for the "
                                        "others in one hand-over or all-reduce; at least the longest stage rank 0 "
                                        "runs alone (recorded episodes: RL's rollouts, correction rounds) while "
                                        "the others wait.")
    fsdp: Sharding = Field("auto", description="Under torchrun: split the base model's weights, "
                                                "the adapter's and its optimizer state over the ranks (FSDP: each "
                                                "decoder layer gathered for its forward and backward) instead of "
                                                "each rank holding them whole. auto: when the weights take over a "
                                                "quarter of one rank's memory (its GPU's; on the CPU the machine's "
                                                "over the ranks).")
    micro_batch_positions: int = Field(768, ge=0, description="Most positions the decoder runs for one micro-batch "
                                       "(its rows' shared prompt once, the rest once a row, padding included): a "
                                       "wider one trains a row at a time, with the same gradient, which bounds the "
                                       "activations a step holds (about 1.3 MB a position on the embedded model; "
                                       "0: no bound).")
    gradient_checkpointing: bool = Field(False, description="Recompute each layer's activations during the backward "
                                         "pass instead of keeping them: a fraction of the memory for about a third "
                                         "more compute, and no prompt shared across a batch (SFT and RL).")
    max_seq_len: int = Field(1024, gt=0, description="Rows longer than this are cut from the left of the prompt.")
    map_large_allocations: bool = Field(False, description="Have glibc map every allocation of 1 MiB or more "
                                        "while training ([[backends]] map_large_allocations): peak RSS falls (4 "
                                        "rows of 512 tokens: 7.7 GB to 4.6 GB) but a CPU training step takes about "
                                        "a third longer, from the page faults.")
    tool_rendering: Rendering = Field("compact", description="How tool specs are written into training "
                                      "prompts ('hermes' or 'compact', as [[backends]] tool_rendering); recorded "
                                      "in each adapter folder (rendering.json), which is served the same way.")
    checkpoints: int = Field(1, gt=0, description="Checkpoints saved per run, evenly spaced; validation picks one "
                             "when there are several.")
    seed: int = Field(0, description="Seed for shuffling, mixing and initialisation.")
    min_recovered_share: float = Field(0.2, ge=0, le=1, description="Least share of rows from trajectories that "
                                       "recovered after a failed tool call (repeated to reach it).")
    general_share: float = Field(0.1, ge=0, lt=1, description="Share of rows from general data, against forgetting.")
    general_data: str | None = Field(None, description="A JSONL file of chat conversations for the general rows "
                                     "and check; default the base model's own answers to prompts shipped "
                                     "with the project.")
    suite: str = Field("tools", description="The task suite replay-train evaluates and gates on.")
    eval_concurrency: int = Field(32, gt=0, description="Episodes run at once during evaluation: the engine's batch "
                                  "(on 2 CPU cores an episode cost a fifth less at 32 than at 8).")
    eval_merge_adapter: bool = Field(True, description="Run an evaluation's adapter merged into the base weights "
                                     "([[backends]] merge_lone_adapter): one adapter at a time, as fast as the base.")
    eval_map_large_allocations: bool = Field(True, description="Have glibc map every allocation of 1 MiB or "
                                             "more while evaluating, as map_large_allocations does for training: "
                                             "the test split's evaluation peaked at 2.6 GB with it against 3.2 GB "
                                             "without, in 349 s against 327 s.")
    eval_batch_cache_mb: int = Field(1536, ge=0, description="Memory for the evaluation batch's keys and values "
                                     "([[backends]] batch_cache_mb): rows wait rather than pad the batch past it "
                                     "(0: no limit).")
    eval_max_tokens: int = Field(160, gt=0, description="Most tokens the model may write per step in an evaluation "
                                 "episode.")
    episode_timeout_seconds: float = Field(600.0, ge=0, description="Wall-clock limit of one episode (evaluation, "
                                           "gate, capture's attempts, expert iteration, RL rollouts): past it the "
                                           "episode is cancelled and counts as a failure (0: none).")
    constrain_tool_calls: bool = Field(True, description="Hold every tool call the model opens in an episode "
                                       "(evaluation, gate, expert iteration, RL rollouts) to a call of an offered "
                                       "tool with valid arguments, as a [[profiles]] constrain_tool_calls does "
                                       "when serving.")
    gate: GateSettings = Field(default_factory=GateSettings, description="[training.gate]: the gate's tasks, "
                               "bounds and margins, below.")
    correction: CorrectionSettings = Field(default_factory=CorrectionSettings, description="[training.correction]: "
                                           "on-policy correction rounds after SFT, below.")
    expert: ExpertSettings = Field(default_factory=ExpertSettings, description="[training.expert]: expert "
                                   "iteration after SFT, below.")
    rl: RLSettings = Field(default_factory=RLSettings, description="[training.rl]: group-relative RL (--mode rl "
                           "and sft+rl), below.")


class HarnessSettings(Settings):
    """Everything one config file holds: the gateway's sections and ``[training]``."""

    training: TrainingSettings = Field(default_factory=TrainingSettings)
