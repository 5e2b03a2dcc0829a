"""The message contract between the ServerApp's strategies and the ClientApp.

Both sides import this package; it imports neither of them.

* :mod:`protocol.keys`: record, config and metric keys, and the client-state directory;
* :mod:`protocol.records`: ArrayRecords to numpy arrays and back, with their checks;
* :mod:`protocol.replies`: what makes a reply usable (finite metrics and arrays, a
  valid example count);
* :mod:`protocol.masking`: the SecAgg+ masks both the clients and the server compute.
"""
