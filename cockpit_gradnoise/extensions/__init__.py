"""The BackPACK extensions the quantities request.

Two first-order extensions, built as BackPACK builds its own: a literal
table from module class to module extension in ``__init__``, and
``fail_mode`` passed to BackPACK. Rows are replaced only through BackPACK's
``set_module_extension`` (:func:`override_module_extensions`). Compared with
BackPACK's ``BatchL2Grad`` and ``SumGradSquared``:

- their own savefields, so they never collide with (or get deleted by) the
  same extensions that Cockpit's own quantities request in one backward pass;
- unsupported layers are skipped silently (``FAIL_SILENT``: the quantities
  warn once, naming the parameters) instead of failing on every step;
- ``BatchNorm`` in training mode gives each example's contribution through
  the batch and records that examples interact (:mod:`.batchnorm`);
- ``Embedding`` works for any dtype (:mod:`.embedding`);
- convolution weights get exact per-example norms for any ``groups`` and the
  cheaper of two computations, and their gradient from torch's own
  convolution backward (:mod:`.convolution`);
- ``Linear`` weights on sequences (``[N, L, in]`` inputs) get per-example
  norms by the cheaper of Gram matrices and formation, and when
  :class:`SumsOfContributions` runs in the same backward pass, both results
  from one formation of the per-example gradients (:mod:`.linear`);
- ``LayerNorm``, ``GroupNorm`` and ``RMSNorm`` are supported
  (:mod:`.normalization`; :func:`register_extensions` gives BackPACK's own
  extensions, and so Cockpit's quantities, the same rows);
- :class:`SumsOfContributions` saves ``sum_i x_i`` with ``sum_i x_i**2``,
  both from one computation of the contributions (:mod:`.sums`), so that
  identical examples give a variance of exactly 0.

The third, :class:`LocalGradient`, is requested only under distributed
training, where ``param.grad`` is not this process's own gradient.

A new layer is supported by adding one row to each table below.
"""

from typing import Callable, Dict, Iterable, Mapping, Optional

from cockpit_gradnoise.extensions import (
    arena,
    batchnorm,
    convolution,
    direct,
    embedding,
    facts,
    hf,
    linear,
    normalization,
    own_index,
    scaled_embedding,
    subclasses,
    sums,
    tensor_parallel,
    uses,
)
from cockpit_gradnoise.extensions.fallback import blocks, capture, mixing, regroup, running
from cockpit_gradnoise.extensions.savefields import (  # noqa: F401 (the package's names)
    BATCH_L2_SAVEFIELD,
    LOCAL_GRADIENT_SAVEFIELD,
    SUMS_SAVEFIELD,
)

from backpack.extensions.backprop_extension import FAIL_SILENT, BackpropExtension
from backpack.extensions.firstorder.base import FirstOrderBackpropExtension
from backpack.extensions.firstorder.batch_l2_grad import rnn as l2_rnn
from backpack.extensions.firstorder.gradient import linear as grad_linear
from backpack.extensions.firstorder.gradient import rnn as grad_rnn
from backpack.extensions.module_extension import ModuleExtension
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class _RecordingExtension(FirstOrderBackpropExtension):
    """Records which parameters it wrote on, and from which layers (:mod:`.facts`);
    combines tied parameters' uses, fixes embeddings broadcast over the batch (:mod:`.uses`).

    A subclass of a layer in its table gets the rule :func:`.subclasses.rule_for`
    finds (BackPACK looks rules up by exact class), decided once per class; a
    layer without a rule gets :mod:`.hf`'s rule for its class name, else the
    ``torch.func`` fallback where ``prepare_model`` installed it (:mod:`.fallback`),
    chosen in one place (:meth:`_rules_run`).
    """

    #: Its reducer of a normalization layer's per-example contributions.
    reduce_normalization: Callable

    def __init__(self, savefield: str, module_exts: Dict[type, ModuleExtension], **kwargs):
        self._rules = module_exts
        self._derived: Dict[type, Optional[ModuleExtension]] = {}  # subclass -> rule_for's
        # Class -> the rule of the table or of .hf (None: neither), asked once per class.
        self._by_class: Dict[type, Optional[ModuleExtension]] = {}
        super().__init__(savefield=savefield, module_exts=module_exts, **kwargs)

    def set_module_extension(self, module, extension, overwrite=False):
        super().set_module_extension(module, extension, overwrite=overwrite)
        self._rules[module] = extension
        self._derived.clear()  # derived from rows that may have changed
        self._by_class.clear()

    def __call__(self, module, g_inp, g_out):
        uses.run(self, module, g_inp, g_out, self._results)

    def _results(self, module, g_inp, g_out) -> bool:
        """This extension's results on ``module``'s own parameters; whether a rule covers it.

        Only a module with a rule writes: a module without one may hold a
        parameter its child wrote on (``attention.LinearAttention``'s ``in_proj``),
        which must not count as a second use of it.
        """
        found = facts.recording()
        found.record_owner(module)
        if module.training and isinstance(module, _BatchNorm):
            # Also where no rule covers the layer: the others' rows are contributions.
            found.examples_interact = True
        if self.savefield != SUMS_SAVEFIELD:
            return self._rules_run(module, g_inp, g_out)
        # The sums may lie in one buffer of the backward pass (.arena).
        arena.serve(found, module)
        try:
            return self._rules_run(module, g_inp, g_out)
        finally:
            arena.served(found, module, SUMS_SAVEFIELD)

    def _rules_run(self, module, g_inp, g_out) -> bool:
        """:meth:`_results` once the facts are recorded: the one choice between a rule, the
        fallback and nothing.

        Nothing where the examples' rows of ``module``'s output mix (:mod:`.fallback.mixing`),
        or where a block computes ``module``'s parameters itself (its layers run on
        rows that are not examples, :mod:`.fallback.blocks`); else the rule that covers
        ``module`` (:meth:`rule_of`) runs; else the
        ``torch.func`` fallback where ``prepare_model`` installed it (which
        may itself refuse, warning); else nothing covers ``module`` (``False``:
        it gets no rows, and the quantities name its parameters).
        """
        if mixing.refuse_mixed(module):  # its rows mix the examples (.fallback.mixing)
            return False
        if blocks.covers(module):  # its block computes its parameters' results (.fallback.blocks)
            return False
        if regroup.refuse_orphan(module):  # rows that are not examples, no block around
            return False
        rule = self.rule_of(module)
        if rule is not None:
            direct.run(rule, self, module, g_inp, g_out)  # BackPACK's __call__, less its generic steps
            return True
        if isinstance(getattr(module, capture.ATTRIBUTE, None), capture.Fallback):
            facts.recording().deferring = False  # it compares its own results in the pass
            running.run(self, module, g_inp, g_out)
            return True
        return False

    def rule_of(self, module: nn.Module) -> Optional[ModuleExtension]:
        """This extension's rule for ``module``: the table's for its class or a parent's
        (:meth:`_rule_for`), else :mod:`.hf`'s for its class name, else the Embedding rule
        of a scaled embedding (:mod:`.scaled_embedding`), or of an embedding whose call was
        recorded with the index it built (:mod:`.own_index`: asked per call, in the backward
        pass); ``None`` if none."""
        # BackPACK's own __call__ is a lookup by exact class, and the call.
        cls = type(module)
        if cls in self._by_class:
            rule = self._by_class[cls]
        else:
            rule = self._rule_for(cls)
            rule = self._by_class[cls] = rule if rule is not None else hf.rule_for(self.savefield, module)
        if rule is None and scaled_embedding.is_scaled_embedding(module):
            rule = scaled_embedding.ScaledEmbeddingRule(self._rules[nn.Embedding])
        if rule is None and own_index.built(facts.recording().call):
            rule = self._rules[nn.Embedding]
        return rule

    def _rule_for(self, module_class: type) -> Optional[ModuleExtension]:
        """The table's rule, or the one derived for a subclass (:func:`.subclasses.rule_for`)."""
        if module_class in self._rules:
            return self._rules[module_class]
        if module_class not in self._derived:
            self._derived[module_class] = subclasses.rule_for(
                module_class, self._rules, self.reduce_normalization
            )
        return self._derived[module_class]


class PerExampleSquaredNorms(_RecordingExtension):
    """``||x_i||^2`` per example and parameter, saved as ``param.cgn_batch_l2`` (``[N]``)."""

    reduce_normalization = staticmethod(normalization.squared_norms)

    def __init__(self):
        super().__init__(
            savefield=BATCH_L2_SAVEFIELD,
            module_exts={
                nn.Linear: linear.SquaredNormsLinear(),
                nn.Conv1d: convolution.SquaredNormsConv(),
                nn.Conv2d: convolution.SquaredNormsConv(),
                nn.Conv3d: convolution.SquaredNormsConv(),
                nn.ConvTranspose1d: convolution.SquaredNormsConv(),
                nn.ConvTranspose2d: convolution.SquaredNormsConv(),
                nn.ConvTranspose3d: convolution.SquaredNormsConv(),
                nn.RNN: l2_rnn.BatchL2RNN(),
                nn.LSTM: l2_rnn.BatchL2LSTM(),
                nn.BatchNorm1d: batchnorm.BatchL2BatchNormAnyMode(),
                nn.BatchNorm2d: batchnorm.BatchL2BatchNormAnyMode(),
                nn.BatchNorm3d: batchnorm.BatchL2BatchNormAnyMode(),
                nn.Embedding: embedding.BatchL2EmbeddingAnyDtype(),
                **normalization.module_extensions(normalization.squared_norms),
            },
            fail_mode=FAIL_SILENT,
        )


class SumsOfContributions(_RecordingExtension):
    """``[sum_i x_i, sum_i x_i**2]`` per element, saved as ``param.cgn_sums_of_contributions``.

    Shape ``[2, *param.shape]``. Both sums come from one computation of the
    contributions ``x_i`` (:mod:`.sums`), so that identical examples give a
    variance of exactly 0; a convolution's weight whose square is expanded
    over its few positions has a third row, ``R``, the absolute terms of the
    rounding bound (:mod:`.conv_math`, ``[3, *param.shape]``); ``sum_i x_i``
    is this backward pass's own gradient on this process, also under
    distributed training. On the CPU the sums of several layers may be
    slots of one buffer (:mod:`.arena`), which GradientVarianceQuantiles
    overwrites with sd and SNR.
    """

    reduce_normalization = staticmethod(sums.sums_of)

    def __init__(self):
        super().__init__(
            savefield=SUMS_SAVEFIELD,
            module_exts={
                nn.Linear: linear.SumsLinear(),
                nn.Conv1d: convolution.SumsConv(),
                nn.Conv2d: convolution.SumsConv(),
                nn.Conv3d: convolution.SumsConv(),
                nn.ConvTranspose1d: convolution.SumsConv(),
                nn.ConvTranspose2d: convolution.SumsConv(),
                nn.ConvTranspose3d: convolution.SumsConv(),
                nn.RNN: sums.SumsRNN(),
                nn.LSTM: sums.SumsLSTM(),
                nn.BatchNorm1d: batchnorm.SumsBatchNormAnyMode(),
                nn.BatchNorm2d: batchnorm.SumsBatchNormAnyMode(),
                nn.BatchNorm3d: batchnorm.SumsBatchNormAnyMode(),
                nn.Embedding: embedding.SumsEmbeddingAnyDtype(),
                **normalization.module_extensions(sums.sums_of),
            },
            fail_mode=FAIL_SILENT,
        )


class LocalGradient(_RecordingExtension):
    """``sum_i x_i`` of this backward pass on this process, saved as ``param.cgn_local_grad``.

    What ``param.grad`` holds on one process. Under DistributedDataParallel
    ``param.grad`` is averaged across processes (and inside ``no_sync()`` it
    accumulates micro-batches), so the quantities that need this process's
    own gradient request it there (one more weight-gradient product per layer).
    """

    reduce_normalization = staticmethod(normalization.gradient)

    def _rules_run(self, module, g_inp, g_out) -> bool:
        if tensor_parallel.splits(module):  # BackPACK's rule checks the global shape
            return tensor_parallel.save_local_gradient(self, module, g_out)
        return super()._rules_run(module, g_inp, g_out)

    def __init__(self):
        super().__init__(
            savefield=LOCAL_GRADIENT_SAVEFIELD,
            module_exts={
                nn.Linear: grad_linear.GradLinear(),
                nn.Conv1d: convolution.GradConv1dFast(),
                nn.Conv2d: convolution.GradConv2dFast(),
                nn.Conv3d: convolution.GradConv3dFast(),
                nn.ConvTranspose1d: convolution.GradConvTranspose1dFast(),
                nn.ConvTranspose2d: convolution.GradConvTranspose2dFast(),
                nn.ConvTranspose3d: convolution.GradConvTranspose3dFast(),
                nn.RNN: grad_rnn.GradRNN(),
                nn.LSTM: grad_rnn.GradLSTM(),
                nn.BatchNorm1d: batchnorm.GradBatchNormAnyMode(),
                nn.BatchNorm2d: batchnorm.GradBatchNormAnyMode(),
                nn.BatchNorm3d: batchnorm.GradBatchNormAnyMode(),
                nn.Embedding: embedding.GradEmbeddingAnyDtype(),
                **normalization.module_extensions(normalization.gradient),
            },
            fail_mode=FAIL_SILENT,
        )


def override_module_extensions(
    extensions: Iterable[BackpropExtension],
    rows: Mapping[type, Mapping[type, ModuleExtension]],
) -> None:
    """Replace rows of extension instances, through BackPACK's ``set_module_extension``.

    For measurements and experiments: for example, to run a quantity with
    BackPACK's own convolution rules, pass the extensions it requests
    (``quantity.extensions(step)``, the instances it keeps) and
    ``{SumsOfContributions: {nn.Conv2d: rule, ...}}``.

    Args:
        extensions: BackPACK extension instances.
        rows: ``{extension class: {module class: module extension}}``; every
            instance of an extension class given (or of a subclass) gets those
            rows, replacing its own.
    """
    for extension in extensions:
        for extension_class, replacements in rows.items():
            if isinstance(extension, extension_class):
                for module_class, module_extension in replacements.items():
                    extension.set_module_extension(module_class, module_extension, overwrite=True)


def register_extensions() -> None:
    """Give BackPACK's own first-order extensions this package's layer support.

    After this call, every ``BatchGrad``, ``BatchL2Grad``, ``SumGradSquared``
    and ``Variance`` constructed (by you, by Cockpit's own quantities) supports
    ``LayerNorm``, ``GroupNorm`` and ``RMSNorm``, so Cockpit's quantities stop
    failing on models with these layers. Importing the package changes nothing
    in BackPACK; only this call does. Undo it with :func:`unregister_extensions`.
    This package's own quantities do not need it.
    """
    normalization.register_normalization_extensions_globally()


def unregister_extensions() -> None:
    """Undo :func:`register_extensions` for extensions constructed from now on."""
    normalization.unregister_normalization_extensions_globally()


def has_rule(module: nn.Module) -> bool:
    """Whether the package's extensions have a native rule for ``module``
    (a table row for its class or a parent's, or :mod:`.hf`: ``rule_of``); the others with
    direct parameters get the ``torch.func`` fallback (``prepare_model`` passes this
    function to :func:`.fallback.install_fallback`)."""
    extensions = (PerExampleSquaredNorms(), SumsOfContributions(), LocalGradient())
    return any(ext.rule_of(module) is not None for ext in extensions)
