// TODO(skeleton)
