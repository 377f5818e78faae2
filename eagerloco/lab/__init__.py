"""The lab: what runs eagerloco's experiments, apart from the library a user trains with.

:mod:`.compare` (``eagerloco compare`` and ``eagerloco demo``: grids of runs, seeds, tuning, reports)
and :mod:`.kernel_link` (``eagerloco launch --kernel-link-gbps``: a slow link shaped by the kernel,
as root). The lab imports the library; the library never imports the lab.
"""
