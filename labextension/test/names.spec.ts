/**
 * The naming dialog's rules are the store's (core/store/snapshot.py, validate_name), plus the
 * names already taken; the field's HTML pattern carries them, so the dialog refuses a bad
 * name as it is typed.
 */
import { isFreeName, namePattern } from '../src/names';

// The rules need no dialog: none of apputils is loaded (it takes jest long to transform).
jest.mock('@jupyterlab/apputils', () => ({ Dialog: {}, showDialog: jest.fn() }));

describe('a snapshot name, as the naming dialog takes it', () => {
  it.each([
    ['before-training', true],
    ['demo-14.32', true],
    ['a', true],
    ['x'.repeat(64), true],
    ['x'.repeat(65), false],
    ['bad/name', false],
    ['my snapshot', false],
    ['-leading', false],
    ['.hidden', false],
    ['trailing.', false],
    ['trailing-', false],
    ['two..dots', false],
    ['', false]
  ])('%s: %s', (name, valid) => {
    expect(isFreeName(name)).toBe(valid);
  });

  it('refuses a name another snapshot has, and only that one', () => {
    const taken = ['first-steps', 'demo-14.32'];
    expect(isFreeName('first-steps', taken)).toBe(false);
    expect(isFreeName('demo-14.32', taken)).toBe(false);
    // The dot of a taken name is a dot, not "any character".
    expect(isFreeName('demo-14x32', taken)).toBe(true);
    expect(isFreeName('first-steps-2', taken)).toBe(true);
  });

  it("is a pattern the browser's 'v' flag takes too: '-' escaped in classes", () => {
    const pattern = namePattern(['a.b']);
    expect(pattern).toContain('[A-Za-z0-9._\\-]');
    expect(pattern).not.toMatch(/[^\\]-\]/);
  });
});
