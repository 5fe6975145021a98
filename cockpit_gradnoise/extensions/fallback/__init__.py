"""Exact per-example results of any module that uses its parameters directly, by ``torch.func``.

A module that uses its own parameters in ``forward`` (``x * self.gamma``,
``F.layer_norm(x, ..., self.weight, self.bias)``, a class token or a position
table added to its input) has no rule in the extension tables. Its
parameters' per-example contributions are still exact vector-Jacobian
products of that module's own forward pass, as Opacus computes them for
layers without a rule (``opacus/grad_sample/functorch.py``): with ``a_i`` the
module's input(s) of example ``i``, ``G_i`` the gradient of the batch's loss
with respect to its output of example ``i`` and ``f`` its forward pass,

.. math::

    x_i(\\theta) = \\Big(\\frac{\\partial f(a_i; \\theta)}{\\partial \\theta}\\Big)^{\\top} G_i ,

``torch.func.vmap`` over the examples of ``torch.func.vjp`` of the module's
forward with its own direct parameters as the primal. ``G`` is the
output gradient the backward pass hands the module, of the batch's loss: for
a mean-reduced loss it holds the ``1/N``, so ``x_i`` is the contribution
``c g_i`` of the package's contract, as for every other rule. The rest of the
network is computed as before; the vector-Jacobian product runs over the
module's own forward only, with its own parameters as the primal.

Per-layer reductions only: the per-example gradients of one module's
parameters, for a chunk of examples at a time (:func:`.cost_model.examples_per_chunk`),
are reduced at once to the three results the extensions save
(``||x_i||^2``, ``[sum_i x_i, sum_i x_i**2]``, ``sum_i x_i``) and freed.
A bias added by ``F.linear`` and used nowhere else is held back to the end
(it is small): the gradient at that call's output holds the terms of each
contribution, so its structural zeros (an attention key's bias) are exact
zeros, as the native Linear rule makes them (:class:`.replay._LinearBiases`,
:func:`.sums.structural_zeros`).

How it is wired, one file each:

- :mod:`.capture`: :func:`install_fallback` (called by ``prepare_model``,
  told which modules have a rule) puts forward hooks on each module with
  direct trainable parameters that no rule covers and on its direct
  children, which keep the call (:class:`~.capture.Call`) and the
  children's calls (:class:`~.capture.ChildCall`) until the backward pass;
- :mod:`.closed_form`: a module that behaves like a layer scale or a layer
  norm gets that closed form instead of the ``vmap``;
- :mod:`.replay`: the per-example gradients, the module's forward under
  ``vmap`` with its children's calls replayed instead of run;
- :mod:`.reduce`: the three results from chunks of per-example gradients;
- :mod:`.running`: :func:`~.running.run`, called by the package's extensions on the
  modules that have the fallback (the one choice between a rule, the
  fallback and nothing is theirs, ``_RecordingExtension._rules_run``):
  once per module and backward pass, every active package extension's
  results, each extension taking its own;
- :mod:`.several`: a module called several times in one forward pass (T5Gemma2's
  ``k_norm`` on its own keys and the encoder's): its calls' contributions summed per
  example before they are reduced;
- :mod:`.blocks`: a module's parent that runs it on rows that are not examples (a
  mixture-of-experts block's router and experts on flattened tokens) takes over:
  it is run again on each example alone, and gives every parameter inside it its rows;
  :mod:`.block_vmap` runs it on a chunk of examples at once where ``vmap`` can;
- :mod:`.parameters`: which parameters, and the module run with others in
  their place and without its hooks;
- :mod:`.draws`: a forward that draws random numbers in training mode (dropout, drop path
  run again inside the module: timm's BEiT and EVA-02 around their class token, XLNet's
  block) is run again on each example alone with its part of the batch's draws, recorded
  from the random state of the call (``vmap`` cannot replay them: the loop runs).

A module's caches of tensors computed from its parameters (timm's eval-mode
``attention_bias_cache``, :func:`.parameters.parameter_caches`) are emptied at
each recorded call, as the model's own ``train()`` empties them (the outputs
are the same), and bypassed in the recomputation, which would otherwise read
the cache instead of the parameters' copies (rows of zeros).

Refused, with a warning and without rows (never a silently wrong number):
a module none of whose inputs leads with the batch dimension of its output,
a module with a BatchNorm in training mode inside (its examples interact), a
forward pass ``vmap`` cannot run per example (data-dependent Python; random
operations whose draws have no dimension of the examples: :mod:`.draws`), and an input changed in
place after the call, and a parameter the forward pass used that the
recomputation did not use (a tensor computed from it and kept: :func:`.replay.used_by_forward`),
and a module whose first output does not depend on the batch (:mod:`.layout`). A later
output of a tuple (the hooks hand over the first's gradient only) has its gradient kept by
a tensor hook (:mod:`.capture`), and the module computes at the end of the backward pass:
one per example is used as the first; one that got no gradient reached no loss. Left out by
name (the quantities leave it out, warning): a parameter that reaches an output with a
gradient but none per example, one without the batch dimension (GPT-NeoX-Japanese's attention
returns its ``dense_bias`` for its parent to add: that gradient is the batch's sum) or a
parameter returned as it is (:func:`.replay.per_example_gradients`).
Inside the recomputation, the hooks of the module and
its submodules are switched off (:func:`.parameters.hooks_off`): BackPACK's would
overwrite the inputs it stored for the real backward pass.
"""

from cockpit_gradnoise.extensions.fallback.blocks import install_fallback
from cockpit_gradnoise.extensions.fallback.capture import ATTRIBUTE, PARENT_ATTRIBUTE, Fallback

# The face: what prepare_model and the checker read of a module's fallback.
__all__ = ["ATTRIBUTE", "PARENT_ATTRIBUTE", "Fallback", "install_fallback"]
