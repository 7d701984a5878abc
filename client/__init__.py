"""kvpool: the client library of kvpoold."""
