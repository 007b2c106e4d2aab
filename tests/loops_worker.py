"""Training loops from the ecosystem, run the way their users write them, by
test_training_loops.py in a child process (``USE_TORCH_XLA=0`` must be set before
transformers is imported, and accelerate keeps process-wide state).

A tiny Llama built from a config (no download) learns a synthetic language: sequences
from a fixed random Markov chain. Each loop trains it three ways on the same data from the
same seed: ``fp32`` (fp32 model, torch AdamW: the reference), ``bf16`` (bf16 model, torch
AdamW: no master weights) and ``smp`` (bf16 model, nxd_smp's Zero1Optimizer). What counts
is the held-out loss of the trained weights, evaluated in fp32.
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings

import torch

VOCAB, SEQ, BATCH, ACCUM, LR = 64, 32, 8, 4, 3e-3
STEPS = 60  # the convergence run's length; the suite passes a shorter one (``main``'s ``steps``)


def markov_data(n: int, seed: int) -> torch.Tensor:
    """``n`` sequences from a fixed chain: each token has 3 likely successors."""
    chain = torch.Generator().manual_seed(1234)
    successors = torch.randint(0, VOCAB, (VOCAB, 3), generator=chain)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.empty(n, SEQ, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(1, SEQ):
        pick = torch.randint(0, 3, (n,), generator=g)
        tokens[:, t] = successors[tokens[:, t - 1], pick]
    return tokens


def make_model(dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).to(dtype)


def make_optimizer(kind: str, model, **zero1_kwargs):
    import nxd_smp

    hyper = dict(lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    if kind == "smp_memory_options":  # both memory options (README, "Memory options")
        options = nxd_smp.MixedPrecisionConfig(use_sharded_grad_acc=True, use_param_remainders=True)
        return nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.AdamW, mixed_precision=options,
                                      **zero1_kwargs, **hyper)
    if kind == "smp":
        return nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.AdamW, **zero1_kwargs, **hyper)
    # the reference clips as nxd_smp does (max_norm 1.0): torch's own clip_grad_norm_
    return torch.optim.AdamW(model.parameters(), **hyper)


@torch.no_grad()
def held_out_loss(model) -> float:
    reference = make_model(torch.float32)
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    tokens = markov_data(64, seed=99)
    return float(reference(input_ids=tokens, labels=tokens).loss)


def train_data() -> torch.Tensor:
    return markov_data(BATCH * ACCUM * STEPS, seed=1)


def clip_warnings(caught) -> int:
    """How many of the warnings ``caught`` say a clip_grad_norm_ found no .grad (nxd_smp's)."""
    return sum("clip_grad_norm_ found no .grad" in str(w.message) for w in caught)


# ---------------------------------------------------------------- Hugging Face Trainer
def hf_trainer(kind: str, callback: bool = False) -> dict:
    import ast
    import contextlib
    import io

    from transformers import Trainer, TrainerCallback, TrainingArguments

    import nxd_smp
    from nxd_smp.interop.hf_trainer import Zero1TrainerCallback

    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    model = make_model(dtype)
    # built with another max_norm on purpose: the callback makes TrainingArguments govern
    optimizer = make_optimizer(kind, model, **({"max_norm": 0.3} if callback else {}))
    norms = []
    if isinstance(optimizer, nxd_smp.Zero1Optimizer):
        original_step = optimizer.step

        def step(*args, **kwargs):
            out = original_step(*args, **kwargs)
            norms.append(float(optimizer.grad_norm))
            return out

        optimizer.step = step
    data = [{"input_ids": t, "labels": t} for t in train_data()]
    with tempfile.TemporaryDirectory() as out_dir:
        args = TrainingArguments(
            output_dir=out_dir, per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM,
            max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", logging_steps=1,
            report_to="none", save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
            max_grad_norm=1.0,
        )
        reported = []

        class Reporter(TrainerCallback):  # (a report_to integration: a callback added before nxd_smp's)
            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "grad_norm" in logs:
                    reported.append(float(logs["grad_norm"]))

        trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, None),
                          callbacks=[Reporter()])
        if callback:
            trainer.add_callback(Zero1TrainerCallback(trainer))
        printed = io.StringIO()
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(printed):
            warnings.simplefilter("always")
            trainer.train()
    logged = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    lines = [ast.literal_eval(line) for line in printed.getvalue().splitlines() if line.startswith("{'loss'")]
    return {
        "held_out": held_out_loss(model),
        "train_loss": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "logged_grad_norm": logged,
        "reported_grad_norm": reported,
        "printed_grad_norm": [float(line["grad_norm"]) for line in lines if "grad_norm" in line],
        "optimizer_grad_norm": norms,
        "optimizer_max_norm": getattr(optimizer, "max_norm", None),
        "warnings": [str(w.message) for w in caught if str(w.message).startswith("Zero1TrainerCallback")],
        "clip_warnings": clip_warnings(caught),
    }


# ---------------------------------------------------------------- accelerate
def accelerate_loop(kind: str) -> dict:
    from accelerate import Accelerator

    import nxd_smp

    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    model = make_model(dtype)
    optimizer = make_optimizer(kind, model)
    loader = torch.utils.data.DataLoader(train_data(), batch_size=BATCH, shuffle=False)
    accelerator = Accelerator(gradient_accumulation_steps=ACCUM, cpu=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    norms = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for tokens in loader:
            with accelerator.accumulate(model):
                loss = model(input_ids=tokens, labels=tokens).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:  # (as users write it; nxd_smp's clips inside its step)
                    norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    if not isinstance(optimizer.optimizer, nxd_smp.Zero1Optimizer):
                        norms.append(float(norm))
                optimizer.step()
                optimizer.zero_grad()
                if accelerator.sync_gradients and isinstance(optimizer.optimizer, nxd_smp.Zero1Optimizer):
                    norms.append(float(optimizer.optimizer.grad_norm))
    return {"held_out": held_out_loss(accelerator.unwrap_model(model)), "optimizer_grad_norm": norms,
            "clip_warnings": clip_warnings(caught)}


# ---------------------------------------------------------------- a plain loop
def plain_loop(kind: str) -> dict:
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    model = make_model(dtype)
    optimizer = make_optimizer(kind, model)
    tokens = train_data().view(STEPS, ACCUM, BATCH, SEQ)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            for micro in tokens[step]:
                (model(input_ids=micro, labels=micro).loss / ACCUM).backward()
            if not kind.startswith("smp"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            model.zero_grad()  # never optimizer.zero_grad(), as the Trainer
    return {"held_out": held_out_loss(model), "clip_warnings": clip_warnings(caught)}


LOOPS = {"hf_trainer": hf_trainer, "accelerate": accelerate_loop, "plain": plain_loop}


def main(out_path: str, loop: str, steps: int = STEPS) -> None:
    global STEPS
    STEPS = steps
    torch.set_num_threads(1)  # the same reduction order in every run
    kinds = ("fp32", "bf16", "smp") + (("smp_memory_options",) if loop != "plain" else ())
    runs = {kind: LOOPS[loop](kind) for kind in kinds}
    if loop == "hf_trainer":
        runs["smp_callback"] = hf_trainer("smp", callback=True)
    with open(out_path, "w") as f:
        json.dump(runs, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:4]))
