"""Which phase of a run a failure happened in, read from its stack frames (and, without a traceback, from the
lines before it).

Two kinds of phase. A context says what the run was doing as a whole - loading the model, starting up
(deepspeed.initialize), resuming, saving a checkpoint, evaluating - and decides when present, the outermost
one first: an OOM inside the optimizer's first `step()` that ZeRO-3 runs within deepspeed.initialize to
allocate the states is a start-up failure. Otherwise the innermost operation decides: a ZeRO-3 parameter
gather inside a forward is a gather, DeepSpeed's `engine.step()` called from accelerate's `backward()` is the
optimizer step, and so are torch's and DeepSpeed's optimizer internals (`_multi_tensor_adamw`,
`exp_avg_sq.sqrt()`) even when no frame is called `step`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from .logtext import Frame, Log


@dataclass(frozen=True)
class Rule:
    phase: str
    func: re.Pattern                 # the frame's function name
    file: Optional[re.Pattern] = None  # and, when given, its file
    code: Optional[re.Pattern] = None  # or its source line (Python tracebacks print it)

    def matches(self, frame: Frame) -> bool:
        if self.code is not None and frame.code and self.code.search(frame.code):
            return True
        return bool(self.func.fullmatch(frame.func)) and (self.file is None or bool(self.file.search(frame.file)))


def _rule(phase: str, func: str, file: Optional[str] = None, code: Optional[str] = None) -> Rule:
    return Rule(phase, re.compile(func), re.compile(file) if file else None, re.compile(code) if code else None)


ZERO_FILES = r"(deepspeed|zero|stage3|stage_1_and_2|partition_parameters|parameter_offload)"
CONTEXTS = ("loading", "init", "resume", "save", "eval")
RULES = [
    _rule("loading", r"from_pretrained|_load_pretrained_model|_load_state_dict_into\w*|load_sharded_checkpoint|"
                     r"_post_init_method|_convert_to_deepspeed_param|_?from_config|load_model_and_tokenizer"),
    _rule("init", r"initialize|deepspeed_init|_prepare_deepspeed|_configure_\w*optimizer|_configure_distributed_model|"
                  r"_broadcast_model|initialize_optimizer_states|_setup_for_real_optimizer|"
                  r"_create_fp(16|32)_partitions|_create_param_groups_fp16_partitions|_setup_zero_optimizer",
          file=r"deepspeed|accelerate|transformers"),
    _rule("init", r"__init__", file=r"deepspeed[\\/](runtime[\\/](engine|zero)|__init__)"),
    _rule("resume", r"load_checkpoint|_load_checkpoint|_load_zero_checkpoint|load_universal\w*|_load_optimizer_state|"
                    r"_get_all_zero_checkpoint_state_dicts|_load_from_checkpoint|_load_rng_state|"
                    r"load_module_state_dict"),
    _rule("save", r"save_checkpoint|_save_checkpoint|_save_zero_checkpoint|save_16bit_model|"
                  r"_zero3_consolidated_16bit_state_dict|save_pretrained|save_model|_save_optimizer_and_scheduler"),
    _rule("eval", r"evaluate|evaluation_loop|prediction_step|eval_step|_maybe_log_save_evaluate|run_evaluation|"
                  r"validation_step|validate|evaluate_loss"),
    _rule("gather", r"fetch_sub_module|_all_gather\w*|all_gather_coalesced|_allgather_params\w*|"
                    r"pre_sub_module_forward_function|pre_sub_module_backward_function|_pre_forward_module_hook|"
                    r"_pre_backward_module_hook", file=ZERO_FILES),
    _rule("step", r"step|_take_model_step|_optimizer_step|unscale_and_clip_grads|_step_closure|_maybe_opt_step|"
                  r"_(multi|single)_tensor_adamw?|_fused_adamw?|adamw?|update_hp_grads|_use_grad",
          code=r"exp_avg_sq|_foreach_sqrt|\bdenom\b|exp_avg\.|ds_opt_adam\.adam_update|multi_tensor_applier"),
    _rule("backward", r"backward|_backward\w*|run_backward|_engine_run_backward|reduce_ipg_grads|average_tensor|"
                      r"allreduce_gradients|reduce_partition_and_remove_grads|_?_reduce_and_partition_ipg_grads|"
                      r"reduce_ready_partitions_and_remove_grads|independent_gradient_partition_epilogue"),
    _rule("forward", r"forward|_call_impl|_wrapped_call_impl|compute_loss|_forward\w*"),
]

# Without a traceback (a kill, a watchdog), the last of these lines before the failure names the phase.
LINE_PHASES = [
    ("resume", re.compile(r"(Attempting to resume|load_checkpoint|_get_all_zero_checkpoint_state_dicts|"
                          r"optim_states\.pt)")),
    ("loading", re.compile(r"(from_pretrained|_load_pretrained_model|load_state_dict|Loading checkpoint shards|"
                           r"modeling_utils\.py|partition_parameters\.py|zero\.Init|loading weights file|"
                           r"Loading model)")),
    ("init", re.compile(r"(deepspeed\.initialize|in initialize\b|DeepSpeedEngine\(|_configure_optimizer|"
                        r"_configure_zero_optimizer|initialize_optimizer_states|_create_fp32_partitions|"
                        r"DeepSpeedZeroOptimizer|initializing optimizer states|creating fp(16|32) partitions|"
                        r"DeepSpeedZeRoOffload initialize)")),
    ("save", re.compile(r"(Saving model checkpoint|saving checkpoint|save_checkpoint|"
                        r"zero_pp_rank_\d+_mp_rank_\d+_optim|"
                        # FSDP assembling a full state dict for a save: its hooks' own warnings
                        r"returning from state_dict\(\) call|Failed to clone\(\) tensor with name|"
                        r"_full_post_state_dict_hook|FULL_STATE_DICT)")),
    ("eval", re.compile(r"(Running Evaluation|\*+ Running evaluation|eval_loss|Evaluating)")),
    ("training", re.compile(r"(step=\d+|'loss':|\bloss[=:]\s*\d|Epoch \d|global_step|Running training)")),
]

WORDS = {"loading": "while loading the model", "init": "at start-up (deepspeed.initialize)",
         "resume": "while resuming from a checkpoint", "save": "while saving a checkpoint",
         "eval": "during evaluation", "gather": "in a ZeRO-3 parameter gather", "step": "in the optimizer step",
         "backward": "in the backward pass", "forward": "in the forward pass", "training": "during training",
         "unknown": "(the log shows no phase)"}


def frame_phases(frames: list[Frame]) -> list[str]:
    """Each frame's phase ('' for none), outermost first."""
    return [next((rule.phase for rule in RULES if rule.matches(frame)), "") for frame in frames]


def phase_of_frames(frames: list[Frame]) -> Optional[str]:
    """The outermost context in the stack, else its innermost operation, else None."""
    phases = frame_phases(frames)
    context = next((p for p in phases if p in CONTEXTS), None)
    if context is not None:
        return context
    return next((p for p in reversed(phases) if p), None)


def phase_before(log: Log, index: int, window: int = 40) -> str:
    """The phase the lines before `index` show last (a kill leaves no traceback), 'unknown' when none does."""
    latest, phase = -1, "unknown"
    for name, pattern in LINE_PHASES:
        found = max((i for i in range(max(0, index - window), index + 1) if pattern.search(log.lines[i])), default=-1)
        if found > latest:
            latest, phase = found, name
    return phase


def phase(log: Log, index: int) -> str:
    """The phase of the failure at line `index`: from its stack frames, else from the lines before it."""
    return phase_of_frames(log.frames(index)) or phase_before(log, index)
