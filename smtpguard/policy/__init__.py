"""Pure decisions: no sockets, no event loop, no store, and the clock is always a parameter.

Everything that decides what smtpguard answers or writes lives here, so every row of
DESIGN.md §3 is a millisecond unit test. Adapters (listener, store, relay) gather inputs,
ask these functions, and apply what they return.
"""
