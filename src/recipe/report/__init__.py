"""Reporting: ``results.json`` (:mod:`.results`), how a job ended and its last line (:mod:`.ending`), the
FLOP count behind MFU (:mod:`.flops`) and a sweep's summary (:mod:`.sweep`)."""
