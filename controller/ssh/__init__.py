"""Remote boxes over the system's OpenSSH client: argv builders (pure) and the SSH connector."""
