"""The two tasks of :mod:`experiments.critical_batch_size`: the digits CNN (SGD) and a
character-level GPT (Adam) on Python's own standard library. Nothing downloads.
"""

import platform
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, Tuple

import torch
from torch import nn

from experiments.models import GPT, TokenCrossEntropy
from experiments.train_digits import digits_cnn


@dataclass
class Task:
    """One training problem: model, data, optimizer, learning-rate grid and target.

    ``sample(batch_size, generator)`` draws a batch of i.i.d. training
    examples; ``validation_loss(model)`` is the mean loss on a fixed
    validation set; ``losses()`` is ``(mean loss, per-example loss)``.
    """

    name: str
    title: str
    unit: str
    make_model: Callable[[], nn.Module]
    losses: Callable[[], Tuple[nn.Module, nn.Module]]
    sample: Callable[[int, torch.Generator], Tuple[torch.Tensor, torch.Tensor]]
    validation_loss: Callable[[nn.Module], float]
    optimizer: str  # "sgd" (plain) or "adam"
    learning_rates: Sequence[float]
    target: float
    max_steps: int
    eval_examples: int  # evaluate every max(1, eval_examples // B) steps
    gns_batch: int
    description: str = ""
    data_note: str = ""

    def eval_every(self, batch_size):
        return max(1, self.eval_examples // batch_size)

    def make_optimizer(self, params, lr):
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=lr)
        return torch.optim.Adam(params, lr=lr)


def digits_task(learning_rates, target, max_steps, gns_batch, seed=0) -> Task:
    """The digits CNN of ``experiments.train_digits`` with plain SGD; its 1500/297 split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    train, val = order[:1500], order[1500:]

    def sample(batch_size, generator):
        index = train[torch.randint(len(train), (batch_size,), generator=generator)]
        return images[index], labels[index]

    def validation_loss(model):
        with torch.no_grad():
            return nn.functional.cross_entropy(model(images[val]), labels[val]).item()

    return Task(
        name="digits", title="digits CNN (scikit-learn's 8x8 digits)", unit="images",
        make_model=digits_cnn,
        losses=lambda: (nn.CrossEntropyLoss(), nn.CrossEntropyLoss(reduction="none")),
        sample=sample, validation_loss=validation_loss, optimizer="sgd",
        learning_rates=learning_rates, target=target, max_steps=max_steps,
        eval_examples=64, gns_batch=gns_batch,
        description="`experiments.train_digits.digits_cnn` (2 convolutions, 2 linear layers, "
                    "6,922 parameters), cross-entropy, plain SGD (no momentum, constant "
                    "learning rate)",
        data_note="1,500 training images (batches drawn uniformly with replacement), the "
                  "other 297 for validation (the split of `experiments.train_digits`)",
    )


#: Standard-library files read for the character-level model, in this order.
STDLIB_FILES = (
    "argparse.py", "ast.py", "base64.py", "bisect.py", "calendar.py", "csv.py",
    "dataclasses.py", "difflib.py", "enum.py", "fractions.py", "functools.py", "heapq.py",
    "inspect.py", "os.py", "random.py", "shutil.py", "string.py", "textwrap.py",
    "threading.py", "tokenize.py", "typing.py", "weakref.py", "json/decoder.py",
    "json/encoder.py", "logging/__init__.py", "collections/__init__.py",
    "email/message.py", "http/client.py", "unittest/case.py",
)
#: Newline and printable ASCII: 96 characters.
VOCABULARY = "\n" + "".join(chr(c) for c in range(32, 127))
#: Tabs and every other character outside the vocabulary become this one.
REPLACEMENT = "?"


def encode_text(text) -> torch.Tensor:
    """Indices into :data:`VOCABULARY`; characters outside it map to :data:`REPLACEMENT`."""
    index = {c: i for i, c in enumerate(VOCABULARY)}
    other = index[REPLACEMENT]
    return torch.tensor([index.get(c, other) for c in text], dtype=torch.long)


def stdlib_text(files=STDLIB_FILES, validation_fraction=0.1):
    """Train and validation characters from the standard library's own sources.

    Each file's last ``validation_fraction`` goes to validation, the rest to
    training (so both see every file's style). Files this Python lacks are
    left out, with a warning.

    Returns:
        ``(train, validation, files used)``: two 1-d index tensors and the
        list of the files read.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val, used = [], [], []
    for name in files:
        path = root / name
        if not path.is_file():
            warnings.warn(f"{path} does not exist in this Python; left out", stacklevel=2)
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        cut = int(len(text) * (1 - validation_fraction))
        train.append(text[:cut])
        val.append(text[cut:])
        used.append(name)
    if not used:
        raise FileNotFoundError(f"none of the standard-library files exist under {root}")
    return encode_text("\n".join(train)), encode_text("\n".join(val)), used


def gpt_task(learning_rates, target, max_steps, gns_batch, seed=0, context=32,
             validation_windows=256) -> Task:
    """A 2-layer character-level GPT (width 64, context ``context``) with Adam."""
    train, val, used = stdlib_text()
    # Fixed validation windows, the same for every run.
    starts = torch.randint(len(val) - context - 1, (validation_windows,),
                           generator=torch.Generator().manual_seed(seed + 1))
    val_x = torch.stack([val[s:s + context] for s in starts])
    val_y = torch.stack([val[s + 1:s + context + 1] for s in starts])

    def sample(batch_size, generator):
        s = torch.randint(len(train) - context - 1, (batch_size,), generator=generator)
        window = s[:, None] + torch.arange(context + 1)
        chunk = train[window]
        return chunk[:, :-1], chunk[:, 1:]

    def validation_loss(model):
        with torch.no_grad():
            return TokenCrossEntropy()(model(val_x), val_y).item()

    return Task(
        name="gpt", title=f"character-level GPT (Python's standard library, context {context})",
        unit=f"sequences of {context} characters",
        make_model=lambda: GPT(len(VOCABULARY), context, width=64, heads=4, layers=2),
        losses=lambda: (TokenCrossEntropy(), TokenCrossEntropy("none")),
        sample=sample, validation_loss=validation_loss, optimizer="adam",
        learning_rates=learning_rates, target=target, max_steps=max_steps,
        eval_examples=512, gns_batch=gns_batch,
        description=f"`experiments.models.GPT` (2 pre-norm blocks, width 64, 4 heads, "
                    f"context {context}, vocabulary {len(VOCABULARY)}, untied head, 114,048 "
                    f"parameters), mean per-token cross-entropy, Adam (constant learning rate)",
        data_note=f"{len(used)} files of the standard library of Python "
                  f"{platform.python_version()} ({', '.join(used)}); each file's first 90% "
                  f"for training ({len(train):,} characters, windows drawn uniformly), its "
                  f"last 10% for validation ({len(val):,} characters, {validation_windows} "
                  f"fixed windows); newline and printable ASCII, every other character "
                  f"(tabs included) read as `{REPLACEMENT}`",
    )
