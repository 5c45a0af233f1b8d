// Unit tests of the extension's logic (test/*.spec.ts), with JupyterLab's own jest set-up:
// ts-jest for our TypeScript, babel for the ES modules some @jupyterlab/* packages ship,
// and a jsdom environment.
const jupyterLabConfig = require('@jupyterlab/testing/lib/jest-config');

// Packages that ship ES modules: jest runs CommonJS, so babel converts them.
const esModules = [
  '@codemirror',
  '@jupyter/',
  '@jupyterlab/',
  '@marijn',
  '@microsoft',
  'color',
  'exenv-es6',
  'lib0',
  'marked',
  'nanoid',
  'vscode-ws-jsonrpc',
  'y-protocols',
  'y-websocket',
  'yjs'
].join('|');

const base = jupyterLabConfig(__dirname);

module.exports = {
  ...base,
  // No junit.xml left in the source tree and no GitHub annotations: jest's own summary.
  reporters: ['default'],
  // jsdom itself: the template's environment also copies Node's File into the page, and
  // Node 18 (Debian 12) has none.
  testEnvironment: 'jsdom',
  testRegex: '/test/.*\\.spec\\.tsx?$',
  transformIgnorePatterns: [`/node_modules/(?!${esModules}).+`]
};
