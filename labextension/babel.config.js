// babel-jest turns the ES modules of some @jupyterlab/* dependencies into CommonJS.
module.exports = require('@jupyterlab/testing/lib/babel-config').default;
