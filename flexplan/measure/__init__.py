"""Measuring: the harness above the executor that times this machine and writes factors.

``flexplan calibrate`` (``calibrate``) drives the micro-benchmarks (``microbench``,
``microbench_gpu``, ``stream``) and the memory and compute probes (``membw``, ``state``), and
writes a calibration file that :mod:`flexplan.factors` reads. The planner never imports this
package: a plan runs no benchmark or probe unless its caller measures first and passes the
factors in.
"""
