"""Where this package's extensions save their results on each parameter."""

BATCH_L2_SAVEFIELD = "cgn_batch_l2"
LOCAL_GRADIENT_SAVEFIELD = "cgn_local_grad"
SUMS_SAVEFIELD = "cgn_sums_of_contributions"
