"""What a log means: the ranking and thresholds, the findings and the report, the panels
and the dashboard.

The views import only :mod:`cockpit_gradnoise.logs` and each other, down one
stack (``common``, ``axes`` -> ``findings``, ``panels`` -> ``report`` ->
``dashboard`` -> ``reads`` -> ``sources``); :mod:`.sources` is where a source
(a path, a Cockpit, a tracker, a frame) becomes the rows a view reads. This
package imports nothing itself, so that the command line's ``--help`` stays
free of pandas and matplotlib.
"""
