"""One entry point that makes a model ready for the per-example quantities.

By default the model is left as it is written and gets this package's hooks
(:mod:`cockpit_gradnoise.extensions.hooks`): in-place operations on layer
outputs (``ReLU(inplace=True)``, a ResNet's ``out += identity``) work, and
submodules called ``output`` (Hugging Face's BERT) are left alone. BackPACK's
own hooks turn module outputs into views, which in-place operations break;
its converter (``backpack.extend(model, use_converter=True)``) rewrites the
model with ``torch.fx`` to avoid that, and stays available here for
BackPACK's second-order extensions (Cockpit's ``HessTrace``, ``TICDiag``),
which need hooks on every module.

Every prepared model gets one switch for the package's hooks
(:class:`~cockpit_gradnoise.extensions.hooks.Switch`), on by default: a
:class:`~cockpit_gradnoise.Tracker` turns the hooks off for the forward
passes of steps at which no quantity needs per-example results, and they are
then out of the modules' hook tables (parked), so that those forward passes
run as the plain model's.
"""

import contextlib
import sys
from typing import Optional

from cockpit_gradnoise import distributed, fsdp2
from cockpit_gradnoise.attention import convert_attention
from cockpit_gradnoise.extensions import has_rule, uses
from cockpit_gradnoise.extensions.fallback import install_fallback
from cockpit_gradnoise.extensions.hooks import add_hooks, install_switch

from backpack import extend
from backpack.custom_module.graph_utils import BackpackTracer
from torch import nn


def prepare_model(model: nn.Module, *, use_converter: Optional[bool] = False) -> nn.Module:
    """Make ``model`` ready for the per-example quantities.

    By default ``model`` itself, given hooks in place
    (:func:`~cockpit_gradnoise.extensions.hooks.add_hooks`): one forward hook
    on each module with parameters of its own, which hooks the gradient of
    that call's output. Nothing is traced or rewritten, so the model behaves
    as written (``train()``/``eval()``, dropout, in-place operations, custom
    methods), and every first-order BackPACK extension (this package's, and
    Cockpit's ``BatchGrad``, ``BatchL2Grad``, ``SumGradSquared``) runs on it.

    Every ``nn.MultiheadAttention`` is first replaced, in place, by a
    :class:`~cockpit_gradnoise.LinearAttention` with the same parameters
    (:func:`~cockpit_gradnoise.convert_attention`).

    Example (torchvision's ResNets use ``ReLU(inplace=True)`` and
    ``out += identity``)::

        model = cgn.prepare_model(torchvision.models.resnet18(num_classes=10))

    A model already extended by ``backpack.extend`` is returned as it is
    (BackPACK's own hooks then record every forward pass).

    A model already sharded with FSDP2 (``fully_shard``, on a 1-D mesh over
    two processes or more) is prepared as if before sharding: the hooks run
    before FSDP2's (:mod:`~cockpit_gradnoise.fsdp2`).

    The model's hooks share one switch
    (:class:`~cockpit_gradnoise.extensions.hooks.Switch`), on: they record
    every forward pass with gradients, as the explicit API needs.
    :func:`~cockpit_gradnoise.track` gives it to the tracker, which parks the
    hooks (takes them out of the modules' hook tables) for the forward passes
    of untracked steps; torch.compile, made to guard on hooks, compiles the
    model at most once with them and once without.

    Where ``torch.compile`` has been used in this process, its compiled graphs
    are dropped and it is made to guard on module hooks
    (:func:`make_compile_see_hooks`), so that no graph compiled without the
    hooks runs this model.

    Args:
        model: The network.
        use_converter: ``True`` for BackPACK's converter and its hooks on every
            module (only for BackPACK's second-order extensions): a
            ``torch.fx.GraphModule`` that shares ``model``'s parameters under
            the same names. ``False`` or ``None`` (default): the hooks.

    Returns:
        The model to train.

    Raises:
        TypeError: If the model is sharded or split across processes (FSDP,
            tensor parallelism, DeepSpeed, pipeline parallelism, FSDP2 but on a
            1-D mesh over two processes or more), see
            :func:`~cockpit_gradnoise.distributed.check_not_sharded`; if a model
            sharded by FSDP2 holds an ``nn.MultiheadAttention`` or
            ``use_converter`` is set (:func:`~cockpit_gradnoise.fsdp2.check_preparable`).
        RuntimeError: With ``use_converter=True``, if the model's traced code
            depends on ``self.training`` (the converter would freeze it: a
            ``.train()`` or ``.eval()`` later would not change what dropout
            or drop-path do), or if the converter changed parameter names.
    """
    sharded_first = fsdp2.fully_sharded(model)  # fully_shard before: as if prepared first
    split_first = fsdp2.is_sharded(model.parameters())  # or parallelize_module (DTensors)
    distributed.check_not_sharded(model.parameters(), model, fsdp2=sharded_first, hsdp=True,  # before any change
                                  tensor_parallel=split_first, fsdp2_tensor_parallel=split_first)
    if sharded_first or split_first:
        fsdp2.check_preparable(model, use_converter)
    with fsdp2.hooks_as_if_prepared_first(model) if sharded_first or split_first else contextlib.nullcontext():
        return _prepare(model, use_converter)


def _prepare(model: nn.Module, use_converter: Optional[bool]) -> nn.Module:
    model = convert_attention(model)  # same parameters, same names (attention.py)
    install_fallback(model, has_rule)  # modules that use their parameters directly (extensions.fallback)
    if not use_converter:
        if not any(getattr(module, "_backpack_extend", False) for module in model.modules()):
            add_hooks(model)
            make_compile_see_hooks()
        model = uses.install(model)  # tied parameters, embeddings without the batch
        install_switch(model)
        return model
    _refuse_frozen_training_flag(model)
    names = [name for name, _ in model.named_parameters()]
    converted = extend(model, use_converter=True)
    converted_names = [name for name, _ in converted.named_parameters()]
    if converted_names != names:
        raise RuntimeError(
            "BackPACK's converter changed the parameter names "
            f"({sorted(set(names) ^ set(converted_names))[:4]}...): use "
            "prepare_model(model) without the converter"
        )
    converted = uses.install(converted)  # tied parameters, embeddings without the batch
    install_switch(converted)  # the fallback's and the tied uses' hooks (BackPACK's always record)
    return converted


def traced_code(model: nn.Module, training: bool) -> str:
    """The Python code of ``model`` traced as BackPACK's converter traces it, in one mode.

    Every module's ``training`` flag is restored afterwards.
    """
    flags = {module: module.training for module in model.modules()}
    try:
        model.train(training)
        return BackpackTracer().trace(model).python_code("self").src
    finally:
        for module, flag in flags.items():
            module.training = flag


def _refuse_frozen_training_flag(model: nn.Module) -> None:
    """Refuse the converter where the traced model would keep one mode forever."""
    try:
        differs = traced_code(model, True) != traced_code(model, False)
    except Exception as error:  # untraceable (data-dependent Python)
        raise RuntimeError(
            f"BackPACK's converter cannot trace this model ({type(error).__name__}: "
            f"{error}): use cockpit_gradnoise.prepare_model(model) without the converter"
        ) from error
    if differs:
        raise RuntimeError(
            "BackPACK's converter would freeze this model's training mode: its forward reads "
            "`self.training` in Python (dropout, drop-path or BatchNorm written with "
            "F.dropout(..., training=self.training)), and the traced graph keeps the value "
            "of the moment of conversion. Use cockpit_gradnoise.prepare_model(model) without "
            "the converter."
        )


def make_compile_see_hooks() -> None:
    """Make torch.compile notice module hooks, and forget graphs compiled without them.

    TorchDynamo does not guard on module hooks by default
    (``torch._dynamo.config.skip_nnmodule_hook_guards``), so a graph compiled
    for this model's class before the hooks were added (for this instance, or
    for another, such as an untracked copy) would run it without them: no
    per-example results, silently. Done only where ``torch._dynamo`` is already
    imported (importing it takes seconds); where it is not, nothing is compiled
    yet, and a model compiled later, like ``cgn.track(torch.compile(model))``,
    comes back here. Other compiled models recompile at their next call.
    """
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return
    dynamo.config.skip_nnmodule_hook_guards = False
    dynamo.reset()
