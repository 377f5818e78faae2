"""The lab: what runs eagerloco's experiments (comparisons, the demo, corpora, the kernel-shaped link), apart from
the library a user trains with. The lab imports the library; the library never imports the lab.
"""
