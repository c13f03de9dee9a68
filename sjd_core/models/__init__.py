"""Model families behind one protocol (:mod:`.protocol`), the family table (:mod:`.registry`) and
the weight-loading rules they share (:mod:`.weights`). No module here imports the decoding core.
"""
