"""Where this package's extensions save their results on each parameter, and mark tied layers."""

BATCH_L2_SAVEFIELD = "cgn_batch_l2"
LOCAL_GRADIENT_SAVEFIELD = "cgn_local_grad"
#: ``[sum_i x_i, sum_i x_i**2]``, ``[2, *shape]``; ``[3, *shape]`` with the rounding
#: magnitudes ``R`` where a convolution's square is expanded (``conv_math.weight_sums``).
SUMS_SAVEFIELD = "cgn_sums_of_contributions"

#: The attribute of a layer that holds a tied parameter: ``{attribute name: TiedGroup}``,
#: set by ``prepare_model`` (:func:`.tied.mark`).
TIED_ATTR = "_cgn_tied"
