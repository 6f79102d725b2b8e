"""A Hugging Face Trainer with pycomm's compressed DDP hook (2 CPU processes
under torchrun): a tiny GPT-2 built from a config (no download) learns the
bytes of a local text file, its gradients all-reduced in int8 by the hook.

    torchrun --nproc-per-node 2 examples/transformers_train.py --steps 16 --save-at 8 --checkpoint ckpt
    torchrun --nproc-per-node 2 examples/transformers_train.py --steps 16 --resume ckpt/checkpoint-8
    torchrun --nproc-per-node 2 examples/transformers_train.py --compile    # torch_compile=True
    torchrun --nproc-per-node 2 examples/transformers_train.py --onebit-adam  # OneBitAdam instead of the hook

The Trainer saves its checkpoint folders (``checkpoint-N``) as usual;
``compress`` adds each rank's hook state to them (``pycomm_hook_rank{R}.pt``)
and loads this rank's when ``train(resume_from_checkpoint=...)`` resumes:
the resumed run ends with exactly the parameters of the uninterrupted one.
With ``--onebit-adam`` the Trainer's optimizer is OneBitAdam, attached to
its DDP model by ``attach``, which does the same for each rank's optimizer
state (``pycomm_optimizer_rank{R}.pt``).
"""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from pycomm.integrations.transformers import attach, compress
from pycomm.optim import OneBitAdam

from _common import report

SEQ = 32


class Bytes(torch.utils.data.Dataset):
    """Sequences of SEQ bytes of a local text file (this script itself):
    language modelling on bytes, no tokenizer to download."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            self.data = torch.tensor(list(f.read()), dtype=torch.long)

    def __len__(self) -> int:
        return (len(self.data) - 1) // SEQ

    def __getitem__(self, i: int):
        x = self.data[i * SEQ:(i + 1) * SEQ]
        return {"input_ids": x, "labels": x}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps")
    parser.add_argument("--compressor", default="int8", help="the hook's method")
    parser.add_argument("--compile", action="store_true", help="TrainingArguments(torch_compile=True)")
    parser.add_argument("--onebit-adam", action="store_true", help="OneBitAdam as the Trainer's optimizer, no hook")
    parser.add_argument("--checkpoint", help="the Trainer's output folder (checkpoints every --save-at steps)")
    parser.add_argument("--save-at", type=int, default=0, help="save every this many steps")
    parser.add_argument("--resume", help="a checkpoint-N folder to resume from")
    parser.add_argument("--out", help="folder for each rank's JSON report")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the ranks share the machine's cores

    torch.manual_seed(0)  # the same start on every rank
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    output = args.checkpoint or (os.path.dirname(args.resume) if args.resume else tempfile.mkdtemp())
    training = TrainingArguments(
        output, max_steps=args.steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=3e-3, warmup_steps=2, use_cpu=True, ddp_backend="gloo", seed=0, report_to=[],
        logging_strategy="no", save_strategy="steps" if args.save_at else "no", save_steps=args.save_at or None,
        torch_compile=args.compile, torch_compile_backend="eager" if args.compile else None,
        ddp_find_unused_parameters=False, dataloader_num_workers=0, disable_tqdm=True)
    if args.onebit_adam:
        # The momenta compressed (after 4 exact steps), each rank's optimizer state in the checkpoints.
        opt = OneBitAdam(model.parameters(), lr=3e-3, warmup_steps=4, compressor=args.compressor, block_size=256)
        trainer = Trainer(model=model, args=training, train_dataset=Bytes(__file__), optimizers=(opt, None))
        state = attach(trainer)
    else:
        trainer = Trainer(model=model, args=training, train_dataset=Bytes(__file__))
        # The hook on the DDP model the Trainer prepares; each rank's state in its checkpoints.
        state = compress(trainer, compressor=args.compressor, start_iter=4)
    result = trainer.train(resume_from_checkpoint=args.resume)
    report(args.out, dist.get_rank(), model, result.training_loss, state)


if __name__ == "__main__":
    main()
