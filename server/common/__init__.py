"""What every server process shares: settings, security (the cluster token, API keys, auth before the
body), request bounds, the command lines' helpers, and the process's allocator."""
