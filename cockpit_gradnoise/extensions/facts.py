"""What one backward pass revealed about the model, for the quantities to check.

Cockpit runs one instance of each extension class for all the quantities that
request it, so these facts cannot live on an extension instance. The
:class:`~cockpit_gradnoise.step.Step` of a cockpit call starts a new
:class:`BackwardFacts` before the backward pass (:func:`begin`) and keeps it;
the extensions record into the one started last (:func:`recording`).
"""

from collections import Counter
from typing import Dict, Set

from torch import nn

_SEQUENCE_FIRST = (nn.RNN, nn.LSTM)


class BackwardFacts:
    """Facts about the current backward pass.

    Attributes:
        examples_interact: A layer mixed the examples of the batch (BatchNorm
            in training mode).
        uses: ``{(extension class, id(param)): count}``, how many layers wrote
            one extension's result on a parameter: more than one for a
            parameter shared by several layers (tied weights).
        shared_ids: ``{id(param)}`` of the parameters some extension wrote on
            more than once (what :meth:`shared` asks; a set, as it is asked
            for every parameter by every quantity).
        leading_sizes: ``{id(param): size}``, the size of the batch dimension
            of the output of the layer that owns the parameter: not the batch
            size for a layer applied without the batch dimension
            (``wpe(torch.arange(T))``).
        owners: ``{id(param): class name}`` of the module that owns each
            parameter, also where no rule covered it (for the warning that
            names the layers without rows).
    """

    def __init__(self):
        self.examples_interact = False
        self.uses: Counter = Counter()
        self.shared_ids: Set[int] = set()
        self.leading_sizes: Dict[int, int] = {}
        self.owners: Dict[int, str] = {}

    def record(self, extension, module: nn.Module, grad_output):
        """Record the parameters of ``module`` that ``extension`` wrote a result on."""
        batch_axis = 1 if isinstance(module, _SEQUENCE_FIRST) and not module.batch_first else 0
        for param in module.parameters(recurse=False):
            if param.requires_grad and hasattr(param, extension.savefield):
                key = (type(extension), id(param))
                self.uses[key] += 1
                if self.uses[key] > 1:
                    self.shared_ids.add(id(param))
                self.leading_sizes[id(param)] = grad_output[0].shape[batch_axis]

    def record_owner(self, module: nn.Module):
        """Record ``module``'s class as the owner of its own parameters (the first module
        seen holding one: in the backward pass, a child before its parent)."""
        for param in module.parameters(recurse=False):
            self.owners.setdefault(id(param), type(module).__name__)

    def shared(self, param) -> bool:
        """Whether several layers wrote one extension's result on ``param``."""
        return id(param) in self.shared_ids


#: The facts of the backward pass being run: replaced, never reset, by :func:`begin`,
#: so facts a Step holds are never changed by a later backward pass.
_RECORDING = [BackwardFacts()]


def begin() -> BackwardFacts:
    """New facts, into which the extensions record from now on."""
    _RECORDING[0] = BackwardFacts()
    return _RECORDING[0]


def recording() -> BackwardFacts:
    """The facts the extensions record into (those of the last :func:`begin`)."""
    return _RECORDING[0]
