"""Embeddings whose ``forward`` scales ``nn.Embedding``'s output by a constant.

Gemma, Gemma2, Gemma3, BART, BioGPT and a dozen other ``transformers`` models
look their tokens up with a subclass of ``nn.Embedding`` whose ``forward`` is
``super().forward(input_ids) * embed_scale``. BackPACK looks rules up by
exact class, and :mod:`.subclasses` gives a subclass that overrides
``forward`` no rule, so the torch.func fallback computed the layer's own
rows; but where the weight is tied to the head (:mod:`.tied`), the cross
terms of the two uses were formed from the gradient at the *scaled* output,
as if it were the gradient at the lookup: off by the factor ``s`` (``sqrt(d)``
for Gemma), silently.

Here such a class is recognized by its behaviour (:func:`is_scaled_embedding`,
once per module): with hooks off and other weights in place of its own, its
``forward`` must equal ``F.embedding(index, weight) * s`` for one constant
``s``, in training and in evaluation mode, and at every row of the table (a
forward that writes a parameter into the rows of one token, T5Gemma2's
``eoi_embedding``, is not a scaled lookup there: the ``Embedding`` rule would give
that token's row the gradient of the output that overwrote it). It then gets the ``nn.Embedding``
rule with the output gradient multiplied by ``s`` (:class:`ScaledEmbeddingRule`),
which is the gradient at the lookup's output exactly as autograd forms it
(``d(e * s)/de = s``), and the tied and broadcast paths read their gradient
through :func:`lookup_gradient`. ``s`` is read from the module at each use
(:func:`output_scale`: its forward on a weight of ones), in the module's dtype,
so a model cast to another dtype after it was prepared keeps exact rows.
"""

from typing import Optional

from cockpit_gradnoise.extensions.fallback.parameters import hooks_off, own_parameters
from cockpit_gradnoise.extensions.subclasses import inherits_forward

import torch
from torch import Tensor, nn

#: The attribute of an ``nn.Embedding`` subclass that holds :func:`is_scaled_embedding`'s verdict.
VERDICT_ATTR = "_cgn_scaled_embedding"


def _forward(module: nn.Embedding, weight: Tensor, index: Tensor, training: bool) -> Tensor:
    """``module.forward(index)`` with ``weight`` in place of its own, without hooks or grad."""
    modes = {m: m.training for m in module.modules()}
    try:
        module.train(training)
        with hooks_off(module), own_parameters(module, {"weight": weight}), torch.no_grad():
            return module.forward(index)
    finally:
        for m, mode in modes.items():
            m.training = mode


def _probe(module: nn.Embedding) -> bool:
    rows, width = module.num_embeddings, module.embedding_dim
    generator = torch.Generator().manual_seed(0)
    index = torch.randint(0, rows, (2, 5), generator=generator)
    ones = torch.ones(1, width, dtype=torch.float64).expand(rows, width)
    # Distinct rows in rows + width numbers (a real [V, d] table can be gigabytes).
    values = torch.randn(rows + width - 1, dtype=torch.float64, generator=generator)
    weight = values.as_strided((rows, width), (1, 1))
    scale = None
    for training in (True, False):
        scale = _scale_at(module, ones, weight, index, training)
        if scale is None:
            return False
    # Every row once (a forward that writes a parameter into the rows of one token, as
    # T5Gemma2's embedding writes its eoi_embedding, passes at random indices), in chunks.
    # Distinct rows suffice there: a factor per row or per column breaks the equality too.
    chunk = max(1, _PROBE_ELEMENTS // width)
    for start in range(0, rows, chunk):
        every = torch.arange(start, min(start + chunk, rows)).unsqueeze(0)
        if not _looked_up(module, weight, every, False, scale):
            return False
    return True


#: Output elements of one chunk of :func:`_probe`'s pass over every row.
_PROBE_ELEMENTS = 1 << 20


def _scale_at(module: nn.Embedding, ones: Tensor, weight: Tensor, index: Tensor, training: bool,
              scale: Optional[Tensor] = None) -> Optional[Tensor]:
    """The one factor ``s`` with ``forward(index) = F.embedding(index, weight) * s`` (with
    ``ones``, then distinct rows, in place of its weight; ``scale``: the one it must be), or
    ``None`` where there is none."""
    width = ones.shape[1]
    scaled = _forward(module, ones, index, training)
    if not isinstance(scaled, Tensor) or scaled.shape != (*index.shape, width):
        return None
    scale = scaled.reshape(-1)[0] if scale is None else scale
    if not bool((scaled == scale).all()):  # a per-row or per-column factor: not a constant
        return None
    return scale if _looked_up(module, weight, index, training, scale) else None


def _looked_up(module: nn.Embedding, weight: Tensor, index: Tensor, training: bool,
               scale: Tensor) -> bool:
    """Whether ``forward(index)`` with ``weight`` in place of its own is
    ``F.embedding(index, weight) * scale`` (to 1e-12 of its largest value)."""
    output = _forward(module, weight, index, training)
    if not isinstance(output, Tensor) or output.shape != (*index.shape, weight.shape[1]):
        return False
    expected = torch.nn.functional.embedding(index, weight) * scale
    return bool(((output - expected).abs() <= 1e-12 * expected.abs().max()).all())


def is_scaled_embedding(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Embedding`` subclass whose ``forward`` overrides the
    parent's and computes ``F.embedding(index, weight) * s`` (decided once per module), and
    holds no parameter but its weight: the rule is the weight's, and a module with a rule
    gets no other (T5Gemma2's ``eoi_embedding``, used only at a token the sweep's tiny
    vocabulary lacks, would have no rows; the fallback recomputes them all per example)."""
    if not isinstance(module, nn.Embedding) or inherits_forward(type(module), nn.Embedding):
        return False
    if any(name != "weight" and param is not None for name, param in module._parameters.items()):
        return False
    verdict = module.__dict__.get(VERDICT_ATTR)
    if verdict is None:
        try:
            verdict = _probe(module)
        except Exception:  # a forward that needs more than an index: not a scaled lookup
            verdict = False
        module.__dict__[VERDICT_ATTR] = verdict
    return verdict


def output_scale(module: nn.Embedding) -> Tensor:
    """``s`` of a scaled embedding now, in its weight's dtype and on its device (0-d)."""
    weight = module.weight
    ones = torch.ones(1, module.embedding_dim, dtype=weight.dtype, device=weight.device)
    index = torch.zeros(1, 1, dtype=torch.long, device=weight.device)
    return _forward(module, ones.expand(module.num_embeddings, -1), index, module.training)[0, 0, 0]


def lookup_gradient(module: nn.Module, grad_output: Tensor) -> Optional[Tensor]:
    """The gradient at ``F.embedding``'s output inside ``module``, from its output gradient:
    ``grad_output`` for ``nn.Embedding``'s own forward, times ``s`` for a scaled embedding;
    ``None`` for any other forward."""
    if isinstance(module, nn.Embedding) and inherits_forward(type(module), nn.Embedding):
        return grad_output
    if is_scaled_embedding(module):
        return grad_output * output_scale(module)
    return None


class ScaledEmbeddingRule:
    """The ``nn.Embedding`` rule of a scaled embedding: its output gradient times ``s``."""

    def __init__(self, embedding_rule):
        self.embedding_rule = embedding_rule

    def __call__(self, ext, module, g_inp, g_out):
        return self.embedding_rule(ext, module, g_inp, (lookup_gradient(module, g_out[0]),))
