"""What edge and cloud share: the wire protocol, errors, sockets, sampling and acceptance rules, model loading."""
