"""The serving core: every request, from the server's hand-off to its record, on one step loop.

request.py    the Request the server builds (and hands to the core once), modes, the result
text.py       incremental detokenisation and stop strings
policy.py     the arm per request with the batch in view, the drift guard, persistence
scheduler.py  the step loop's thread: the only place in serving that starts one
core.py       ServingCore (the hand-off, rewards, draft swaps) and make_core / build_core
heap.py       the start-up heap frozen out of the garbage collector's way; GC pauses timed
"""
