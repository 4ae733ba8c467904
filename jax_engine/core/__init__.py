"""Engine-side bookkeeping: block pool, KV-cache manager and scheduler.

Same policies as `reference/` (tests compare their decisions step by step), built for speed: block ids are
plain ints, block hashes are computed once per full block, the free-block queue is an OrderedDict and the
scheduler's queues are lists kept sorted by arrival.
"""
