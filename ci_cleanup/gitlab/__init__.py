"""GitLab's shared mechanisms (schema, exclusive lease, feature flags, Sidekiq status), each once."""
