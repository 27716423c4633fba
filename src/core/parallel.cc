// TODO(skeleton): to be written.
